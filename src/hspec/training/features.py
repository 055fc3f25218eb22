"""Target features for drafter training, computed once per sequence and shared by every drafter kind.

For a training sequence (prompt + the target's response) the target runs once and we keep:
- the hidden states of the selected layers at every position (S, n_sel, H) — the drafter's context;
- the K/V of the target layers some drafter reads in place, (S, Hkv, D) each, post-RoPE;
- the final normed hidden state (S, H), from which the target's distribution at any position is
  rebuilt exactly with the frozen LM head (storing V-sized distributions would be V/H times larger);
- the teacher's summary at every position: the log-normaliser of the target's logits and their argmax,
  (S,) each. With them a training step needs the LM head's rows of the draft vocabulary only (Vp of V):
  p(v) = exp(logit_v - lse) for v in it, and the greedy token for validation. The full-vocabulary head
  runs once per sequence here instead of once per step and drafter kind (it was a quarter of a CPU step).

`OnlineFeatures` computes them when training asks for a sequence instead of reading a cache: on a GPU
the target's forward pass costs less than reading the cache back, and nothing is stored; a training step's
sequences go through the target together (`compute_features_batch`).

Legend: S sequence length, n_sel selected layers, H hidden, Hkv KV heads, D head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hspec.cache.paged_pool import pages_for
from hspec.models.llama import TargetModel
from hspec.training.datagen import read_corpus
from hspec.training.precision import full_precision


@dataclass(frozen=True)
class SequenceFeatures:
    tokens: torch.Tensor  # (S,) long
    prompt_length: int  # responses start here; anchors are drawn from the response
    hidden: torch.Tensor  # (S, n_sel, H) at the layers in `target_layers`
    target_layers: tuple[int, ...]
    final_hidden: torch.Tensor  # (S, H) after the target's final norm
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # pool layer -> (k, v), each (S, Hkv, D)
    target_lse: torch.Tensor | None = None  # (S,) fp32 logsumexp of the target's logits; None until `with_teacher`
    target_argmax: torch.Tensor | None = None  # (S,) long, the target's greedy next token

    def to(self, device: torch.device | str) -> SequenceFeatures:
        """These features on `device` (self when they are there already)."""
        device = torch.device(device)
        if self.hidden.device == device:
            return self
        return SequenceFeatures(
            tokens=self.tokens.to(device), prompt_length=self.prompt_length, hidden=self.hidden.to(device),
            target_layers=self.target_layers, final_hidden=self.final_hidden.to(device),
            kv={layer: (k.to(device), v.to(device)) for layer, (k, v) in self.kv.items()},
            target_lse=None if self.target_lse is None else self.target_lse.to(device),
            target_argmax=None if self.target_argmax is None else self.target_argmax.to(device))

    def with_teacher(self, model: TargetModel) -> SequenceFeatures:
        """These features with the teacher's summary (self when they hold it; computed otherwise)."""
        if self.target_lse is not None and self.target_argmax is not None:
            return self
        lse, argmax = teacher_summary(model, self.final_hidden)
        return replace(self, target_lse=lse, target_argmax=argmax)

    @torch.no_grad()
    def teacher(self, head_rows: torch.Tensor, positions: torch.Tensor) -> TeacherDistribution:
        """The target's next-token distribution at `positions` (...), on the draft vocabulary.

        head_rows: (Vp, H) the target LM head's rows of the draft vocabulary. Overlapping blocks ask for
        the same position several times: each distinct one is computed once. Computed in the target's
        own dtype even under a bf16-autocast training step: this is the teacher.
        """
        if self.target_lse is None or self.target_argmax is None:
            raise ValueError("these features lack the teacher's summary; call with_teacher(model) first")
        return teacher_at(self.final_hidden, self.target_lse, self.target_argmax, head_rows, positions)


@dataclass(frozen=True)
class TeacherDistribution:
    """The target's distribution at some positions (...), as the loss and validation read it."""

    on_vocab: torch.Tensor  # (..., Vp) fp32 probabilities of the draft-vocabulary tokens (they sum to <= 1)
    argmax: torch.Tensor  # (...,) long, the target's greedy token (over the full vocabulary)


@torch.no_grad()
def teacher_at(final_hidden: torch.Tensor, lse: torch.Tensor, argmax: torch.Tensor, head_rows: torch.Tensor,
               positions: torch.Tensor) -> TeacherDistribution:
    """`SequenceFeatures.teacher` over any positions: final_hidden (P, H), lse (P,), argmax (P,) at positions
    0..P-1 (of one sequence, or of several laid end to end); positions (...) index them."""
    distinct, where = torch.unique(positions, return_inverse=True)
    h = final_hidden[distinct].to(head_rows.dtype)
    with full_precision(h.device):
        logits = F.linear(h, head_rows).float()  # (P', Vp)
    probs = torch.exp(logits - lse[distinct, None])
    return TeacherDistribution(probs[where], argmax[positions])


TEACHER_ROWS_PER_PASS = 256  # positions per full-vocabulary LM-head product (256 x V fp32 logits at a time)


@torch.no_grad()
def teacher_summary(model: TargetModel, final_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp (S,) fp32, argmax (S,) long) of the target's logits from its final hidden states (S, H).

    A function of `final_hidden` and the model only (fixed passes of `TEACHER_ROWS_PER_PASS` rows), so a
    summary stored with the features equals one computed later from the same stored hidden states.
    """
    lse, argmax = [], []
    with full_precision(final_hidden.device):
        for h in final_hidden.split(TEACHER_ROWS_PER_PASS):
            logits = model.lm_head(h.to(model.embed_tokens.weight.dtype)).float()  # (rows, V)
            lse.append(torch.logsumexp(logits, dim=-1))
            argmax.append(logits.argmax(-1))
    return torch.cat(lse), torch.cat(argmax)


@torch.no_grad()  # not inference_mode: training saves these tensors for its backward pass
def compute_features(model: TargetModel, tokens: Sequence[int], prompt_length: int, target_layers: Sequence[int],
                     kv_layers: Sequence[int], page_size: int = 64) -> SequenceFeatures:
    """Run the target over `tokens` once and keep what training needs (see module docstring)."""
    return compute_features_batch(model, [(tokens, prompt_length)], target_layers, kv_layers, page_size)[0]


@torch.no_grad()
def compute_features_batch(model: TargetModel, sequences: Sequence[tuple[Sequence[int], int]],
                           target_layers: Sequence[int], kv_layers: Sequence[int], page_size: int = 64
                           ) -> list[SequenceFeatures]:
    """`compute_features` for several (tokens, prompt_length) sequences in one target forward: each padded at
    its end to the longest (a causal model's positions never see what follows them), then cut back to its own
    length. On a GPU one forward of B sequences costs about what one of a sequence does (launches, not
    arithmetic, set it); the values equal `compute_features`' to the products' rounding in a batch."""
    if not sequences:
        return []
    L = model.config.num_layers
    wanted = tuple(sorted(set(target_layers) | {L}))
    lengths = [len(tokens) for tokens, _ in sequences]
    longest = max(lengths)
    device = model.embed_tokens.weight.device
    ids = torch.zeros((len(sequences), longest), dtype=torch.long, device=device)  # (B, S_max), 0 after each end
    for row, (tokens, _) in enumerate(sequences):
        ids[row, :len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
    pool = model.new_pool(num_pages=len(sequences) * pages_for(longest, page_size), page_size=page_size)
    rows = list(range(len(sequences)))
    for row in rows:
        pool.add_sequence(row)
    out = model(ids, pool, rows, hidden_layers=wanted, last_logits_only=True)  # hidden (B, S_max, n_wanted, H)
    features = []
    for row, (length, (_, prompt_length)) in enumerate(zip(lengths, sequences)):
        by_layer = {layer: out.hidden[row, :length, i] for i, layer in enumerate(wanted)}  # each (S, H)
        table = pool.slot_table([row])
        kv = {}
        for layer in kv_layers:
            k, v = pool.gather(layer, table)  # (1, S_max, Hkv, D) views into the temporary pool
            kv[layer] = (k[0, :length].to(pool.product_dtype, copy=True),
                         v[0, :length].to(pool.product_dtype, copy=True))
        features.append(SequenceFeatures(
            tokens=ids[row, :length].clone(), prompt_length=prompt_length,
            hidden=torch.stack([by_layer[layer] for layer in target_layers], dim=1).clone(),
            target_layers=tuple(target_layers), final_hidden=model.norm(by_layer[L]).clone(), kv=kv))
    return features


class OnlineFeatures:
    """Generated corpora read as a feature source: the target computes a sequence's features when it is loaded.

    It answers like the on-disk `FeatureStores` (ids, lengths, available, load, tokens) and orders the
    sequences the same way (corpora in the given order, each sorted by id), so a run on the same corpora
    holds out the same validation sequences whichever source it reads.
    """

    def __init__(self, corpus_paths: Sequence[Path], model: TargetModel, target_name: str,
                 target_layers: Sequence[int], kv_layers: Sequence[int]) -> None:
        if not corpus_paths:
            raise ValueError("no corpus files given")
        self.records: list[dict] = []
        for path in corpus_paths:
            if not Path(path).is_file():
                raise FileNotFoundError(f"no corpus at {path}; make one with `hspec data generate`")
            records = sorted((r for r in read_corpus(Path(path)) if r.get("response_ids")), key=lambda r: r["id"])
            if not records:
                raise ValueError(f"{path} holds no response to train on")
            self.records += records
        self.model, self.target = model, target_name
        self.target_layers, self.kv_layers = tuple(target_layers), tuple(kv_layers)
        self.ids = [r["id"] for r in self.records]
        self.lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in self.records]

    def available(self) -> list[int]:
        return list(range(len(self.records)))

    def load(self, i: int) -> SequenceFeatures:
        return self.load_many([i])[0]

    def load_many(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        """`load` of each of `indices`, in order, from one target forward over the distinct ones
        (`compute_features_batch`): a training step's sequences at the cost of about one on a GPU."""
        distinct = list(dict.fromkeys(indices))
        records = [self.records[i] for i in distinct]
        computed = compute_features_batch(self.model, [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]))
                                                       for r in records], self.target_layers, self.kv_layers)
        by_index = {i: f.with_teacher(self.model) for i, f in zip(distinct, computed)}
        return [by_index[i] for i in indices]

    def tokens(self, i: int) -> torch.Tensor:
        """The token ids of sequence i, (S,) long, on the CPU."""
        r = self.records[i]
        return torch.tensor(r["prompt_ids"] + r["response_ids"], dtype=torch.long)
