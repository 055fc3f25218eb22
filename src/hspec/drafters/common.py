"""What every trained (neural) drafter shares: configuration, the draft block, the pruned-vocabulary
head, the Markov head, block attention over context K/V, and `NeuralDrafter`, the base class that
turns a kind's `block_logits` into proposals.

One block forward (docs/design.md#what-trained-drafters-share):
1. `build_block`: the block [x0, MASK x (K-1)] at positions p..p+K-1;
2. `BlockContext`: everything the forward reads from the target (the selected layers' hidden states
   at position p-1, context K/V with a visibility mask); built from the KV pool at inference and
   from a full target forward in training, so both run the same `block_logits`;
3. `block_logits`: the kind's backbone, U_k over the pruned vocabulary (before the Markov head);
4. the Markov correction l_k = U_k + W2(W1[prev_k]) applied sequentially while drafting (teacher
   forced in training), then the same sampling transform as the target's.

MASK: the block's MASK slots hold `config.mask_token_id = V` (one past the target vocabulary). That id
has no row in the target's embedding; `NeuralDrafter.embed_block` maps it to the drafter's own learned
`mask_embedding` (H,), trained and saved with the drafter. Real tokens use the target's frozen rows.

The target's embedding, LM head and RoPE are shared with the drafter, never copied into its
parameters: they live in `TargetParts`, which `nn.Module` does not register, so they are neither
trained nor saved in `state_dict()`. The configuration lives in `config.py`, the heads in `heads.py`
and block attention in `block_attention.py`; all are re-exported here.

Legend: B batch, N block rows (B at inference, anchors in training), K block, S context keys,
V vocab, Vp pruned vocab, H hidden, Hq/Hkv heads, D head dim, r Markov rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DraftBatch, Drafter, Proposal, one_hot_probs
from hspec.drafters.block_attention import BlockAttention, attend_block
from hspec.drafters.config import (
    DrafterConfig,
    dspark_trainable_params,
    kv_layer_of,
    markov_params,
    select_target_layers,
)
from hspec.drafters.heads import MarkovHead, PrunedVocab, PrunedVocabHead
from hspec.models.config import TargetConfig
from hspec.sampling import SamplingBatch, draw_uniforms, sample_with_uniform

__all__ = [
    "BlockAttention", "BlockContext", "DrafterConfig", "MarkovHead", "NeuralDrafter", "PrunedVocab",
    "PrunedVocabHead", "TargetParts", "attend_block", "build_block", "dspark_trainable_params", "kv_layer_of",
    "markov_params", "select_target_layers",
]

# A proposal reads the context rounded up to this many keys, the ones after it masked: oneDNN creates a
# kernel for every new product shape (~0.7 ms for a bf16 score product on an AMX CPU), and the context a
# draft reads grows with every step, so its products would meet a new shape every step; rounded, every 32
# positions (as the target's attention, `models.layers.key_multiple`).
CONTEXT_MULTIPLE = 32

# ---- the draft block ---------------------------------------------------------------------------------


def build_block(anchor_tokens: torch.Tensor, positions_start: torch.Tensor, K: int, mask_token_id: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block [x0, MASK x (K-1)] and its positions p..p+K-1.

    anchor_tokens (N,) long; positions_start (N,) long, p per row. Returns block_tokens (N, K) and
    positions (N, K), both long.
    """
    if anchor_tokens.dim() != 1 or positions_start.shape != anchor_tokens.shape:
        raise ValueError(f"anchor_tokens and positions_start must both be (N,), got "
                         f"{tuple(anchor_tokens.shape)} and {tuple(positions_start.shape)}")
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    n = anchor_tokens.shape[0]
    block = torch.full((n, K), mask_token_id, dtype=torch.long, device=anchor_tokens.device)  # (N, K)
    block[:, 0] = anchor_tokens
    positions = positions_start.long()[:, None] + torch.arange(K, device=anchor_tokens.device)  # (N, K)
    return block, positions


@dataclass(frozen=True)
class BlockContext:
    """Everything one block forward reads, at inference and in training.

    block_tokens: (N, K) long, [x0, MASK, ..., MASK].
    positions: (N, K) long, p .. p+K-1 (RoPE positions continuing the prefix).
    last_hidden: (N, n_sel, H) target hidden states of the selected layers at position p-1.
    context_kv: per attention module that reads context, (k, v) each (N, S, Hkv, D), K post-RoPE
        (views or expands allowed). Key index s need not equal its position: only the mask matters.
        Training may pass (G, S, Hkv, D) with G dividing N instead: rows are G groups of N/G consecutive
        rows, each group reading one context (the blocks of one sequence; `attend_block`).
    context_mask: (N, S) bool, True where key s is visible to row n (a position < p_n within the
        sliding window, and in row n's own sequence when sequences are packed).
    history: (N, W) long, the W tokens before x0 (-1 before the sequence start), for kinds whose head
        reads the token history (`history_window` > 0: DeLS-Spec's local head); None for the others.
    """

    block_tokens: torch.Tensor
    positions: torch.Tensor
    last_hidden: torch.Tensor
    context_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    context_mask: torch.Tensor
    history: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.block_tokens.shape
        if self.positions.shape != (n, k):
            raise ValueError(f"positions must be {(n, k)}, got {tuple(self.positions.shape)}")
        if self.last_hidden.dim() != 3 or self.last_hidden.shape[0] != n:
            raise ValueError(f"last_hidden must be ({n}, n_sel, H), got {tuple(self.last_hidden.shape)}")
        s = self.context_mask.shape[1] if self.context_mask.dim() == 2 else -1
        if self.context_mask.shape != (n, s):
            raise ValueError(f"context_mask must be ({n}, S), got {tuple(self.context_mask.shape)}")
        for i, (key, value) in enumerate(self.context_kv):
            groups = key.shape[0]
            grouped = key.dim() == 4 and (groups == n or (0 < groups and n % groups == 0))
            if not grouped or key.shape[1] != s or value.shape != key.shape:
                raise ValueError(f"context_kv[{i}] must be ({n}, {s}, Hkv, D) twice (or (G, {s}, Hkv, D), G "
                                 f"dividing {n}), got {tuple(key.shape)} and {tuple(value.shape)}")
        if self.history is not None and (self.history.dim() != 2 or self.history.shape[0] != n):
            raise ValueError(f"history must be ({n}, W), got {tuple(self.history.shape)}")

    @property
    def K(self) -> int:
        return self.block_tokens.shape[1]


# ---- the base class of trained drafters ----------------------------------------------------------


class NativeDrafts(NamedTuple):
    """What one native greedy proposal of one sequence returns (`NativeGreedy`).

    drafts (1, K) long target ids; local (1, K) long draft-vocabulary indices; confidence (1, K) fp32; logits the
    backbone logits U (1, K, Vp); timings, where asked, (sections + 1, 2) fp64 nanoseconds, this thread's CPU time
    then wall time per section and last the whole call's, from its entry into native code (else empty).
    """

    drafts: torch.Tensor
    local: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor
    timings: torch.Tensor


class NativeGreedy(Protocol):
    """A kind's `draft_greedy` compiled to one native call (H-Spec's: drafters/hspec/native.py)."""

    # whether it reads the context K/V as the pool stores them (`block_context(..., as_stored=True)`)
    reads_stored_kv: bool

    @property
    def reads_in_place(self) -> bool:
        """Whether `propose_in_pool` runs here."""
        ...

    def covers(self, ctx: BlockContext) -> bool:
        """Whether this context's proposal runs here (else in Python)."""
        ...

    def covers_batch(self, batch: DraftBatch, K: int) -> bool:
        """`covers` for the context `block_context(batch, K)` makes, before it is made."""
        ...

    def __call__(self, ctx: BlockContext, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft_greedy(ctx, anchor_tokens)`: drafts as draft-vocabulary indices and their confidence."""
        ...

    def propose(self, ctx: BlockContext, anchor_tokens: torch.Tensor, timed: bool = False) -> NativeDrafts:
        """The proposal of a context `covers` takes; `timed`: with its sections' times."""
        ...

    def propose_in_pool(self, anchor_tokens: torch.Tensor, K: int, last_hidden: torch.Tensor, pool: PagedKVPool,
                        seq_id: int, layers: list[int], window: int, timed: bool = False) -> NativeDrafts | None:
        """The same proposal with the context read from the pool in place, without a `BlockContext`; None where
        the context's slots are not consecutive."""
        ...


@dataclass(frozen=True)
class TargetParts:
    """The target's frozen pieces a drafter uses, shared (not copied) and not registered as modules.

    embed_weight: (V, H) detached. lm_head_weight: (V, H) detached. rope: positions (N, K), dtype ->
    cos, sin (N, K, D), the target's own RoPE (theta and scaling). inv_freq: (D/2,) its inverse frequencies
    where `rope` is `models.layers.rope_cos_sin(inv_freq, ...)` (the native proposal then makes it in C++), else
    None.
    """

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    rope: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]
    inv_freq: torch.Tensor | None = None


class NeuralDrafter(Drafter, nn.Module):
    """Base of every trained kind: proposes with one `block_logits` forward + the Markov head.

    A subclass sets `config_class`, implements `default_config`, `build` (its modules) and
    `block_logits`; kinds that read target K/V in place override `reused_kv_layers`, and DFlash-style
    kinds with their own context K/V override `context_pool_layers` (read their drafter layers) and
    `commit` (write them, then call super).

    Per sequence the base keeps only `last_hidden` (n_sel, H): the selected layers' hidden states at
    the last committed position.
    """

    needs_target_model = True
    config_class: type[DrafterConfig] = DrafterConfig
    # Kinds whose trained checkpoint training this kind may start from (`start_from` builds it); DeLS-Spec
    # trains its local head over a frozen, trained DFlash.
    starts_from: tuple[str, ...] = ()

    @classmethod
    def start_from(cls, trained: NeuralDrafter, target_model: nn.Module) -> NeuralDrafter:
        """A drafter of this kind built around `trained`, a drafter of one of the kinds in `starts_from`."""
        raise ValueError(f"drafter kind {cls.kind!r} starts from no other kind's checkpoint, got {trained.kind!r}")

    def __init__(self, target_config: TargetConfig, target_model: nn.Module | None = None,
                 config: DrafterConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        config = self.default_config(target_config) if config is None else config
        if config.kind != self.kind and config.kind not in self.presets:
            raise ValueError(f"config is for kind {config.kind!r}, this drafter is {self.kind!r}"
                             + (f" or one of its presets {list(self.presets)}" if self.presets else ""))
        self.kind = config.kind  # a preset's name (e.g. an H-Spec ablation) or the class's own
        self.config = config
        self.target_layers = tuple(config.target_layers)
        weight = target_model.embed_tokens.weight if target_model is not None else None  # type: ignore[union-attr]
        device = device if device is not None else (weight.device if weight is not None else "cpu")
        dtype = dtype if dtype is not None else (weight.dtype if weight is not None else torch.float32)
        with torch.device(device):
            std = float(weight.detach().float().std()) if weight is not None and weight.device.type != "meta" else 0.02
            self.mask_embedding = nn.Parameter(torch.randn(config.hidden_size) * std)  # (H,)
            self.head = PrunedVocabHead(config.vocab_size, config.draft_vocab_size)
            self.markov = (MarkovHead(config.vocab_size, config.markov_rank, config.draft_vocab_size)
                           if config.markov_rank else None)
            self.build()
        self.to(dtype)
        self._target: TargetParts | None = None
        self._last_hidden: dict[int, torch.Tensor] = {}  # seq_id -> (n_sel, H)
        # `draft_greedy` as one native call for the contexts it covers, bound by `runtime.prepare_for_inference`
        # (drafters/hspec/native.py); None: every proposal runs in Python.
        self.native_greedy: NativeGreedy | None = None
        if target_model is not None:
            self.attach_target(target_model)

    # ---- to implement ----------------------------------------------------------------------------

    @classmethod
    def default_config(cls, target_config: TargetConfig) -> DrafterConfig:
        """This class's own kind's configuration for `target_config` (a preset's: `create_drafter`)."""
        return cls.config_class.from_target(cls.kind, target_config)

    def build(self) -> None:
        """Create the kind's modules from `self.config` (called on the construction device)."""
        raise NotImplementedError

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """Backbone logits U_k over the pruned vocabulary, (N, K, Vp), before the Markov head."""
        raise NotImplementedError

    def context_pool_layers(self, pool: PagedKVPool) -> list[int]:
        """Pool layers whose K/V each context-reading attention module reads, in module order.

        By default the target layers the kind reuses (`reused_kv_layers`): the pool's target layers come
        first, so target decoder layer i is pool layer i. Kinds with their own context K/V return their
        drafter layers of the pool instead.
        """
        return self.reused_kv_layers()

    # ---- target ----------------------------------------------------------------------------------

    def attach_target(self, target_model: nn.Module) -> None:
        """Share the target's embedding, LM head and RoPE (after `check_target`)."""
        self.check_target(target_model.config)  # type: ignore[arg-type]
        inv_freq = getattr(target_model, "inv_freq", None)  # TargetModel's and vLLM's view's: rope_cos_sin's
        self._target = TargetParts(target_model.embed_tokens.weight.detach(),  # type: ignore[union-attr]
                                   target_model.lm_head_weight().detach(), target_model.rope,  # type: ignore[union-attr]
                                   None if inv_freq is None else inv_freq.detach())
        self.head.attach(self._target.lm_head_weight)

    @property
    def target_parts(self) -> TargetParts:
        if self._target is None:
            raise RuntimeError(f"drafter {self.kind!r} has no target attached; pass target_model= or "
                               "call attach_target(target_model)")
        return self._target

    def reused_kv_layers(self) -> list[int]:
        """Target decoder layers whose K/V this kind reads in place (checked against the target)."""
        return []

    def check_target(self, config: TargetConfig) -> None:
        """The target must have this drafter's vocabulary, hidden size and, for reused layers, (Hkv, D)."""
        mine = self.config.target
        if config.vocab_size != mine.vocab_size or config.hidden_size != mine.hidden_size:
            raise ValueError(f"drafter {self.kind!r} was built for (V, H) = ({mine.vocab_size}, {mine.hidden_size}); "
                             f"the target has (V, H) = ({config.vocab_size}, {config.hidden_size})")
        if max(self.config.target_layers) > config.num_layers:
            raise ValueError(f"drafter {self.kind!r} reads target layers {self.config.target_layers}; the target "
                             f"has {config.num_layers} layers")
        if self.reused_kv_layers() and (config.num_kv_heads, config.head_dim) != (mine.num_kv_heads, mine.head_dim):
            raise ValueError(f"drafter {self.kind!r} reuses the K/V of target layers {self.reused_kv_layers()} with "
                             f"(Hkv, D) = ({mine.num_kv_heads}, {mine.head_dim}); the target's K/V are "
                             f"(Hkv, D) = ({config.num_kv_heads}, {config.head_dim}) (paper §5: reused K/V dims "
                             "must match)")
        theirs = (config.rope_theta, config.rope_scaling)
        if self.reused_kv_layers() and theirs != (mine.rope_theta, mine.rope_scaling):
            raise ValueError(f"drafter {self.kind!r} reads post-RoPE target keys built with (theta, scaling) = "
                             f"({mine.rope_theta}, {mine.rope_scaling}); the target uses {theirs}")

    # ---- pieces of a forward ---------------------------------------------------------------------

    def embed_block(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """(N, K) ids, MASK = V -> (N, K, H): the target's frozen rows, the learned embedding for MASK."""
        weight = self.target_parts.embed_weight
        is_mask = block_tokens == self.config.mask_token_id  # (N, K)
        emb = F.embedding(block_tokens.clamp(max=self.config.vocab_size - 1), weight)  # (N, K, H)
        return torch.where(is_mask[..., None], self.mask_embedding.to(emb.dtype), emb)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's RoPE cos/sin (N, K, D) at `positions` (N, K)."""
        return self.target_parts.rope(positions, dtype)

    def markov_logits(self, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """Markov corrections (N, K, Vp) for prev_tokens (N, K), or None without a Markov head."""
        return None if self.markov is None else self.markov(prev_tokens)

    def store_int8(self, compute_dtype: torch.dtype, kernel: str) -> None:
        """Int8 copies (one scale per row) of the products the kind runs outside `nn.Linear`, which
        `models.formats.store` swaps by itself: here the Markov head's W2; kinds with more add theirs.
        Inference only (`runtime.prepare_for_inference`); `kernel` as `models.formats.store.int8_weight` takes it."""
        if self.markov is not None:
            self.markov.store_int8(compute_dtype, kernel)

    def teacher_forced_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Training logits (N, K, Vp): U + W2(W1[prev]) with prev = [x0, x_{p+1}, ..., x_{p+K-1}]."""
        logits = self.block_logits(ctx)
        correction = self.markov_logits(prev_tokens)
        return logits if correction is None else logits + correction

    def context_kv_from_pool(self, pool: PagedKVPool, seq_ids: Sequence[int], lengths: Sequence[int],
                             multiple: int = 1, as_stored: bool = False
                             ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Context K/V of `context_pool_layers` for the last min(p, sliding_window) positions of each row.

        `lengths`: p per row. Read with `PagedKVPool.gather_window`: keys right-aligned (key j of row n
        is position p_n - S + j), keys at negative positions masked, zero-copy views for a single
        sequence; with `multiple`, S' = S rounded up to it, the keys after the S masked (`CONTEXT_MULTIPLE`);
        in the dtype torch's products take them in (the pool's `product_dtype`), or as the pool stores them
        where `as_stored` (the native proposal's kernel widens them as it reads them).
        Returns ([(k, v) each (B, S', Hkv, D)], context_mask (B, S')).
        """
        return pool.gather_window(self.context_pool_layers(pool), seq_ids, lengths, self.config.sliding_window,
                                  multiple, as_stored)

    def context_kv_from_features(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                                 target_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
                                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context K/V of whole sequences as training reads them, one (k, v) per context-reading module.

        tokens (N, S) long; hidden (N, S, n_sel, H) the selected layers' hidden states; positions (N, S);
        target_kv: target pool layer -> (k, v) each (N, S, Hkv, D), the target's cached K/V. This default
        reads the target layers the kind reuses; kinds with their own context K/V compute it instead
        (with gradients). Returns [(k, v) each (N, S, Hkv, D)].
        """
        missing = [layer for layer in self.reused_kv_layers() if layer not in target_kv]
        if missing:
            raise ValueError(f"feature cache lacks the K/V of target layers {missing} that {self.kind!r} reads")
        return [target_kv[layer] for layer in self.reused_kv_layers()]

    def last_hidden_of(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B, n_sel, H) the kept hidden states of each sequence's last committed position."""
        missing = [s for s in seq_ids if s not in self._last_hidden]
        if missing:
            raise KeyError(f"sequences {missing} have no committed hidden state; commit the prefill first")
        return torch.stack([self._last_hidden[s] for s in seq_ids])

    # ---- Drafter interface -----------------------------------------------------------------------

    def check_draft_len(self, K: int) -> None:
        """Raise ValueError unless 1 <= K <= the trained draft length."""
        if not 1 <= K <= self.config.max_draft_len:
            raise ValueError(f"K must be in 1..{self.config.max_draft_len} (the trained draft length), got {K}")

    def block_context(self, batch: DraftBatch, K: int, as_stored: bool = False) -> BlockContext:
        """The block [x0, MASK x (K-1)] of each row with its context: hidden states and the pool's K/V (as the
        pool stores them where `as_stored`: `context_kv_from_pool`)."""
        self.check_draft_len(K)
        lengths = batch.pool.lengths(batch.seq_ids)
        p = torch.tensor(lengths, dtype=torch.long, device=batch.anchor_tokens.device)  # (B,)
        block_tokens, positions = build_block(batch.anchor_tokens, p, K, self.config.mask_token_id)
        context_kv, context_mask = self.context_kv_from_pool(batch.pool, batch.seq_ids, lengths, CONTEXT_MULTIPLE,
                                                             as_stored)
        return BlockContext(block_tokens, positions, self.last_hidden_of(batch.seq_ids), context_kv, context_mask)

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """One block forward, then the sequential Markov correction and sampling (module docstring)."""
        # Greedy drafts are deterministic: their one-hot distributions are not built (`Proposal.draft_probs`).
        native = self.native_greedy if batch.sampling.all_greedy else None
        if native is not None and native.covers_batch(batch, K):  # one native call (drafters/hspec/native.py)
            out = self.native_drafts(native, batch, K)
            return Proposal(out.drafts, None, confidence=out.confidence)
        ctx = self.block_context(batch, K)
        if batch.sampling.all_greedy:
            local, confidence = self.draft_greedy(ctx, batch.anchor_tokens)  # (B, K) x2
            return Proposal(self.head.to_target_ids(local), None, confidence=confidence)
        logits = self.block_logits(ctx)  # (B, K, Vp)
        local, probs, confidence = self.sample_block(logits, batch.anchor_tokens, batch.sampling, batch.generators)
        return Proposal(self.head.to_target_ids(local), self.head.to_full(probs), confidence=confidence)

    def native_drafts(self, native: NativeGreedy, batch: DraftBatch, K: int, timed: bool = False) -> NativeDrafts:
        """`native`'s greedy proposal of `batch`'s one sequence (`covers_batch`): its context read from the pool in
        place where it can (`propose_in_pool`: no `BlockContext` made in Python, ~10 tensor operators fewer, each
        costing tens of microseconds right after a verify), else from `block_context`'s views or copies.
        `timed`: with its sections' times (`hspec bench draft --breakdown`)."""
        self.check_draft_len(K)
        seq_id = batch.seq_ids[0]
        hidden = self._last_hidden.get(seq_id)  # (n_sel, H)
        if native.reads_in_place and hidden is not None:
            out = native.propose_in_pool(batch.anchor_tokens, K, hidden, batch.pool, seq_id,
                                         self.context_pool_layers(batch.pool), self.config.sliding_window, timed)
            if out is not None:
                return out
        return native.propose(self.block_context(batch, K, as_stored=native.reads_stored_kv), batch.anchor_tokens,
                              timed)

    def draft_greedy(self, ctx: BlockContext, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward, then `greedy_block`: drafts (B, K) as draft-vocabulary indices and their
        confidence (B, K) for all-greedy rows. Tensors only, so torch.compile makes the whole greedy
        proposal one compiled call (drafters/compile.py); it calls the class's `block_logits`, never a
        compiled wrapper of it, so the two compile as one graph."""
        return self.greedy_block(type(self).block_logits(self, ctx), anchor_tokens)

    def sample_block(self, logits: torch.Tensor, anchor_tokens: torch.Tensor, sampling: SamplingBatch,
                     generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw d_1..d_K slot by slot: l_k = U_k + W2(W1[prev_k]), prev_0 = x0, prev_k = d_k.

        logits (B, K, Vp) backbone logits; anchor_tokens (B,). The target's sampling transform is
        applied to each l_k; greedy rows take the argmax. Returns the drafts as draft-vocabulary
        indices (B, K), their distributions (B, K, Vp) fp32, and the confidence (B, K): the largest
        probability of softmax(l_k), which for a greedy row is its draft's (`Proposal.confidence`: it must
        not depend on d_k itself, only on the drafts before it).
        """
        if sampling.all_greedy:
            local, confidence = self.greedy_block(logits, anchor_tokens)
            return local, one_hot_probs(local, logits.shape[-1]), confidence
        b, K, _ = logits.shape
        # One draw of K uniforms per row from its own generator, so a row's draws do not depend on
        # which other rows share the batch.
        uniforms = draw_uniforms(generators, K, logits.device)  # (B, K)
        prev = anchor_tokens  # (B,) target ids
        tokens, probs, confidence = [], [], []
        for k in range(K):
            l_k = self.slot_logits(logits[:, k], prev)  # (B, Vp)
            p_k = sampling.probs(l_k[:, None])[:, 0]  # (B, Vp)
            d_k = sample_with_uniform(p_k, uniforms[:, k])
            tokens.append(d_k)
            probs.append(p_k)
            confidence.append(torch.softmax(l_k.float(), -1).amax(-1))
            prev = self.head.to_target_ids(d_k)
        return torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confidence, 1)

    def greedy_block(self, logits: torch.Tensor, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_block` for all-greedy rows, tensors only (compiled inside `draft_greedy`).

        logits (B, K, Vp); anchor_tokens (B,). Returns the drafts as draft-vocabulary indices (B, K) and
        their confidence (B, K): softmax(l_k) at its argmax, which is 1 / sum(exp(l_k - max l_k)).
        """
        prev = anchor_tokens  # (B,) target ids
        tokens, confidence = [], []
        for k in range(logits.shape[1]):
            l_k = self.slot_logits(logits[:, k], prev).float()  # (B, Vp); a bf16 argmax runs 5x slower on CPU
            top, d_k = l_k.max(-1)  # (B,) each
            tokens.append(d_k)
            confidence.append(1.0 / torch.exp(l_k - top[:, None]).sum(-1))
            prev = self.head.to_target_ids(d_k)
        return torch.stack(tokens, 1), torch.stack(confidence, 1)

    def slot_logits(self, backbone: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """l_k = U_k + W2(W1[prev_k]): backbone (B, Vp) logits U_k, prev (B,) target ids -> (B, Vp)."""
        return backbone if self.markov is None else backbone + self.markov(prev[:, None])[:, 0]

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """Keep the hidden states of each row's last committed position (O(1) per sequence)."""
        if hidden is None:
            raise ValueError(f"drafter {self.kind!r} needs the hidden states of layers {self.target_layers}")
        for row, (seq_id, committed) in enumerate(zip(seq_ids, num_committed.tolist())):
            self._last_hidden[seq_id] = hidden[row, committed - 1].clone()  # (n_sel, H), not a view of the step's

    def release(self, seq_id: int) -> None:
        self._last_hidden.pop(seq_id, None)

    # ---- parameters ------------------------------------------------------------------------------

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint saves: trainable weights + the draft vocabulary (never the target's)."""
        return self.state_dict()

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
