"""The drafter interface: propose K tokens and their draft distributions for a batch.

Every kind sees the target only through what the decoding loop hands it: the token history, the
hidden states of the target layers it asked for (at committed positions), and the KV pool, whose
target layers it may read in place. A kind that keeps its own context KV writes it into the pool's
drafter layers from `commit`.

Step protocol for one sequence (docs/design.md#the-decoding-step):
1. `commit(seq_ids, hidden, num_committed)` after the prompt's prefill and after every verify, with
   the target hidden states of the positions that just became part of the verified prefix;
2. `propose(batch, K)`: fill the block [x0, MASK x (K-1)] at positions p..p+K-1 and return the
   drafts d_1..d_K for positions p+1..p+K, with the distributions they were drawn from;
3. `release(seq_id)` when the sequence ends.

Legend: B batch, T committed tokens, K block, V vocab, H hidden.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.models.config import TargetConfig
from hspec.registry import Registry
from hspec.sampling import SamplingBatch

DRAFTERS = Registry("drafter kind")


@dataclass(frozen=True)
class DraftBatch:
    """What a drafter sees for one proposal.

    seq_ids: the sequences, one per row.
    anchor_tokens: (B,) x0, the last token the target produced; not yet in the KV pool.
    tokens: per row, the whole token history (prompt + output, ending with x0). Read only.
    pool: the KV pool; each row's verified prefix of length p is in it.
    sampling: per-row sampling transform, applied to the draft logits as to the target's.
    generators: per-row random generators for drawing draft tokens.
    """

    seq_ids: Sequence[int]
    anchor_tokens: torch.Tensor
    tokens: Sequence[Sequence[int]]
    pool: PagedKVPool
    sampling: SamplingBatch
    generators: Sequence[torch.Generator]

    def select(self, rows: Sequence[int]) -> DraftBatch:
        """The sub-batch of `rows` (indices into this batch), in that order: this batch where that is all of it."""
        if list(rows) == list(range(len(self.seq_ids))):
            return self
        index = torch.tensor(list(rows), dtype=torch.long, device=self.anchor_tokens.device)
        return DraftBatch(seq_ids=[self.seq_ids[r] for r in rows], anchor_tokens=self.anchor_tokens[index],
                          tokens=[self.tokens[r] for r in rows], pool=self.pool, sampling=self.sampling.select(rows),
                          generators=[self.generators[r] for r in rows])


@dataclass(frozen=True)
class Proposal:
    """draft_tokens: (B, K) long. draft_probs: (B, K, V) the distributions they were drawn from, or None where
    every draft was chosen deterministically (greedy rows, prompt lookup): each is then one-hot at its draft, a
    (B, K, V) tensor `probs` builds only for a verifier that reads it (sampled rows; greedy verification reads
    the tokens alone, `decoding.verify.greedy_verdict`), so a greedy proposal does not build it each step.

    num_drafts: (B,) long in 0..K, how many leading drafts of each row to verify (a drafter that is
    unsure after d_n saves the target the cost of scoring the rest; 0 makes the row's step a plain
    decode); None verifies all K. Whatever rule picks n, whether it verifies d_k may depend only on the
    row's own history and d_1..d_{k-1} (and confidences, which depend on no more), never on d_k or later
    drafts nor on the target's verdict, so verification stays exact at any temperature.
    confidence: (B, K) how sure the drafter is at each position before the sampling transform: the
    largest probability of its distribution there (for a greedy row, its draft's probability); what
    `KIND:P` and `KIND:auto` read. It must be a function of the row's history and of d_1..d_{k-1} only,
    never of d_k itself: the choice to verify d_k may then depend on c_1..c_k without biasing sampled
    output (a rule that verified d_k only when d_k itself was likely would favour likely tokens).
    None for drafters without a distribution.
    match_length: (B,) long, for a row drafted by prompt lookup how many trailing tokens of its history the
    match its drafts continue covers (0: the row was drafted otherwise); what `KIND:auto` keeps a record per,
    since a longer match is accepted further. None where the drafter reports none.
    """

    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    num_drafts: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    match_length: torch.Tensor | None = None

    def probs(self, vocab_size: int) -> torch.Tensor:
        """(B, K, V) the distributions the drafts were drawn from: `draft_probs`, or where it is None the
        one-hot distributions of the drafts, built now."""
        return one_hot_probs(self.draft_tokens, vocab_size) if self.draft_probs is None else self.draft_probs


@dataclass(frozen=True)
class TreeDraft:
    """A drafted token tree per row (kinds with `Drafter.proposes_tree`; verified by decoding/tree_step.py).

    tokens: (B, N) long node tokens in topological order (a node's parent comes before it).
    parents: (B, N) long, -1 = a child of x0, else an earlier node's index.
    draft_probs: (B, N+1, V): [:, 0] the distribution x0's children were drawn from, [:, j+1] node j's.
    num_nodes: (B,) long, row b's tree is its first num_nodes[b] nodes, the rest padding (never
    verified; 0: the row drafted nothing, its step is a plain decode); None: all N nodes of every row are real.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor
    num_nodes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, n = self.tokens.shape
        if self.parents.shape != (b, n) or self.draft_probs.shape[:2] != (b, n + 1):
            raise ValueError(f"tokens (B, N), parents (B, N) and draft_probs (B, N+1, V) disagree: "
                             f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, "
                             f"{tuple(self.draft_probs.shape)}")
        bad = (self.parents < -1) | (self.parents >= torch.arange(n, device=self.parents.device))
        if bool(bad.any()):
            row, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"parents[{row}, {j}] = {int(self.parents[row, j])}: a node's parent must be -1 (the "
                             f"root) or an earlier node 0..{j - 1}")
        if self.num_nodes is not None and (self.num_nodes.shape != (b,) or bool((self.num_nodes < 0).any())
                                           or bool((self.num_nodes > n).any())):
            raise ValueError(f"num_nodes must be (B,) = ({b},) in 0..N = 0..{n}, got {self.num_nodes.tolist()}")

    def depths(self) -> torch.Tensor:
        """(B,) long, the depth of each row's tree (its longest root-to-leaf path, padding left out)."""
        b, n = self.parents.shape
        depth = torch.zeros((b, n), dtype=torch.long, device=self.parents.device)
        for j in range(n):  # parents come first, so their depth is known
            parent = self.parents[:, j]
            depth[:, j] = torch.where(parent < 0, 1, depth.gather(1, parent.clamp(min=0)[:, None])[:, 0] + 1)
        if self.num_nodes is not None:
            real = torch.arange(n, device=depth.device) < self.num_nodes[:, None].to(depth.device)
            depth = torch.where(real, depth, 0)
        return depth.max(1).values


class Drafter(ABC):
    """Base class of every drafter kind (registered in `DRAFTERS`)."""

    # The name it is registered under; an instance of one of its `presets` has that preset's name instead.
    kind: str = "abstract"
    # Other kind names the registry gives this class: named configurations of it (H-Spec's ablations,
    # `drafters/hspec/config.py:PRESETS`), built by `create_drafter` with the preset's configuration.
    presets: tuple[str, ...] = ()
    # Target layers (HF hidden-state indices, 0 = embeddings) whose hidden states the drafter needs at
    # committed positions: its config's `target_layers`, or () for a kind that reads none (dflash-kvreuse
    # reads those layers' K/V from the pool instead).
    target_layers: tuple[int, ...] = ()
    # Layers of drafter-owned context KV it needs in the shared pool.
    num_drafter_layers: int = 0
    # False for plain decoding, which drafts nothing (K is forced to 0).
    drafts: bool = True
    # True for trained kinds, which share the target's embedding, LM head and RoPE (`create_drafter`
    # then requires `target_model`).
    needs_target_model: bool = False
    # True for kinds trained with COD sampling (P-Eagle: keep max(0.6^d, 0.2) of anchors at depth d).
    trains_with_cod: bool = False
    # True for kinds whose slot k depends on the draft before it through more than an additive Markov
    # term (DFly, DFlash-2, DeLS-Spec, SpecBlock): the trainer then calls their `training_logits`,
    # which teacher-forces that head and may add a loss of its own.
    sequential_head: bool = False
    # How many tokens before x0 the trainer hands the head as `BlockContext.history` (DeLS-Spec's local
    # window, SpecBlock's block size); 0 for kinds that read no token history. A kind may set it per
    # instance from its config.
    history_window: int = 0
    # The configuration class of trained kinds (`drafter_config` builds one); None for model-free kinds.
    config_class: type | None = None
    # Rows drafted by prompt lookup so far, for kinds that put lookup in front of a model (`KIND+ngram`);
    # None for the others. `hspec eval` reports the share of steps lookup drafted from it.
    lookup_rows: int | None = None
    # True for kinds that draft a token tree (SpecBlock): the decoding step then calls `propose_tree`
    # and verifies the tree (decoding/tree_step.py) instead of calling `propose`.
    proposes_tree: bool = False
    # The vLLM speculative method that serves this kind's export (integrations/vllm/export.py writes it):
    # "dflash" for DFlash, "eagle3" for P-Eagle; None where vLLM serves no export of the kind.
    vllm_method: str | None = None
    # The llama.cpp architecture that runs this kind's GGUF export (integrations/llama_cpp/export.py):
    # "dflash" for DFlash and DSpark; None where llama.cpp runs none.
    llama_cpp_arch: str | None = None
    # Declarations a subclass does not inherit (`__init_subclass__` resets them): a subclass changes what
    # another engine would have to run, so it declares its own.
    _NOT_INHERITED = ("vllm_method", "llama_cpp_arch")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in Drafter._NOT_INHERITED:
            if name not in vars(cls):
                setattr(cls, name, None)

    def check_target(self, config: TargetConfig) -> None:
        """Raise ValueError, naming both shapes, if this drafter cannot serve `config`."""

    @abstractmethod
    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """Draft K tokens per row."""

    def propose_tree(self, batch: DraftBatch, K: int) -> TreeDraft:
        """Draft a token tree of depth <= K per row (kinds with `proposes_tree`)."""
        raise NotImplementedError(f"drafter kind {self.kind!r} drafts chains, not trees")

    def lookup_matches(self, batch: DraftBatch) -> list[int]:
        """Per row, the length of the prompt-lookup match this drafter would draft it by, without running a model
        (0: it would run a model, or draft nothing). Such a row costs nothing to draft, so `KIND:auto` lets it
        draft even while the row backs off the model, as far as its record after such matches says it pays."""
        return [0] * len(batch.seq_ids)

    def draft_positions(self, K: int) -> int:
        """Most tokens after x0 one verification scores: K for a chain, the node budget for a tree."""
        return K

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """Positions [len - num_committed[b], len) of each row just joined its verified prefix.

        hidden: (B, T, len(target_layers), H) target hidden states of the T processed positions, of
        which the first num_committed[b] of row b were committed; None if target_layers is empty.
        The pool has already been rolled back, so `pool.length(seq)` is the new prefix length.
        """

    def release(self, seq_id: int) -> None:
        """Forget everything kept for `seq_id`."""

    def carried_state(self, seq_id: int) -> object | None:
        """What the drafter carries for `seq_id` from one step to the next beyond what a prefill of its
        verified prefix rebuilds (SpecBlock: the inherited layer inputs); None when there is nothing (every
        chain kind). The serving engine keeps it across a preemption (`restore_carried_state`)."""
        return None

    def restore_carried_state(self, seq_id: int, state: object | None) -> None:
        """Put back what `carried_state(seq_id)` returned, after a prefill of the same verified prefix, so
        a recomputed sequence drafts as if it had never left (None: nothing to put back)."""
        if state is not None:
            raise ValueError(f"drafter kind {self.kind!r} carries no state between steps, got a {type(state).__name__}")


def vllm_exported_kinds() -> dict[str, str]:
    """{vLLM method: kind} of the registered kinds that declare one (`Drafter.vllm_method`)."""
    exported: dict[str, str] = {}
    for kind in DRAFTERS.names():
        method = DRAFTERS.get(kind).vllm_method
        if method is not None:
            if method in exported:
                raise ValueError(f"kinds {exported[method]!r} and {kind!r} both declare vLLM method {method!r}")
            exported[method] = kind
    return exported


def one_hot_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, K) tokens -> (B, K, V) one-hot distributions, for drafters that propose deterministically."""
    probs = torch.zeros((*tokens.shape, vocab_size), dtype=torch.float32, device=tokens.device)
    return probs.scatter_(-1, tokens[..., None], 1.0)


def create_drafter(kind: str, target_config: TargetConfig, target_model: torch.nn.Module | None = None,
                   **options) -> Drafter:
    """Instantiate a registered kind for the target `target_config`.

    `target_model` (the `TargetModel`) is required by trained kinds, which share its embedding, LM
    head and RoPE; model-free kinds ignore it.
    """
    cls = DRAFTERS.get(kind)
    if cls.needs_target_model:
        if target_model is None:
            raise ValueError(f"drafter kind {kind!r} needs the target model: pass target_model=")
        options["target_model"] = target_model
    if kind in cls.presets and "config" not in options:  # the class's default is its own kind's
        options["config"] = drafter_config(kind, target_config)
    drafter = cls(target_config, **options)
    drafter.check_target(target_config)
    return drafter


def drafter_config(kind: str, target_config: TargetConfig, **overrides):
    """The default configuration of trained kind `kind` for the target, with `overrides` applied
    (e.g. `draft_vocab_size`); pass it to `create_drafter(..., config=...)`."""
    config_class = DRAFTERS.get(kind).config_class
    if config_class is None:
        raise ValueError(f"drafter kind {kind!r} has no trained configuration (it takes no options like "
                         f"{sorted(overrides)})")
    return config_class.from_target(kind, target_config, **overrides)


def parse_config_options(kind: str, options: Sequence[str], decoding: bool = False) -> dict[str, Any]:
    """`KEY=VALUE` strings (`--drafter-option`) -> overrides for `drafter_config(kind, ...)`.

    A key must be a scalar field of the kind's config (bool, int, float or str, as its default is); the
    value is read as that type (a bool as true/false). `decoding`: only the fields the config names in
    `decoding_options` (what the decoding commands may change on a trained drafter). Errors name the bad
    option and what is allowed.
    """
    config_class = DRAFTERS.get(kind).config_class
    if config_class is None:
        raise ValueError(f"drafter kind {kind!r} has no trained configuration, so no --drafter-option applies")
    settable = {f.name: type(f.default) for f in fields(config_class)
                if f.default is not MISSING and type(f.default) in (bool, int, float, str)
                and (not decoding or f.name in config_class.decoding_options)}
    what = ("the fields of its config that change how a trained drafter decodes, not its weights" if decoding
            else "the scalar fields of its config")
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in settable:
            raise ValueError(f"--drafter-option {option!r} for {kind}: expected KEY=VALUE with KEY one of "
                             f"{sorted(settable)} ({what})")
        kind_of = settable[key]
        if kind_of is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--drafter-option {option!r}: {key} takes true or false")
            parsed[key] = value.lower() == "true"
            continue
        try:
            parsed[key] = kind_of(value)
        except ValueError:
            expected = {int: "an integer", float: "a number"}.get(kind_of, kind_of.__name__)
            raise ValueError(f"--drafter-option {option!r}: {key} takes {expected}") from None
    return parsed
