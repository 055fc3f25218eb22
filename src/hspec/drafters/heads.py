"""Output heads shared by trained drafters: the pruned-vocabulary LM head and DSpark's Markov head.

Both are re-exported by `hspec.drafters.common`. Legend: N rows, K block, H hidden, V vocab,
Vp pruned vocab, r Markov rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hspec.models.formats.base import StoredWeight
from hspec.models.formats.floating import FLOATING, FLOATING_PACKED, pack_weight
from hspec.models.formats.int8 import int8_kernel_fits
from hspec.models.formats.store import int8_weight
from hspec.models.weight_layout import in_fast_layout


class PrunedVocabHead(nn.Module):
    """The target's frozen LM head restricted to the draft vocabulary `draft_vocab_ids` (Vp,).

    The ids are a buffer saved with the drafter (default: the first Vp ids, until training picks the
    most frequent tokens, `set_vocab`). A token outside the draft vocabulary is never drafted (paper
    B.2). The restricted rows are cached as one (Vp, H) copy, neither trained nor saved, refreshed
    whenever the ids or the attached weight change (gathering Vp rows per call would cost more than the
    product), in the memory layout the CPU's GEMM runs fastest for its dtype (`in_fast_layout`: fp32
    column-major, bf16 row-major, 1.4x faster than column-major for a 7-row bf16 block here). Drafting
    in bf16 on a CPU multiplies with a oneDNN-prepacked copy of those rows (`models.formats.floating`: the same
    bits, faster), made on the first such call. `store_int8` (inference under hspec's CPU kernels) makes
    them int8 rows that one of hspec's kernels multiplies: 7 rows x 8192 took 0.58 ms in its int8 kernel and
    0.34 in its w8a8 one against 3.4 ms for the bf16 product on an AVX2-only CPU, whose bf16 is software
    (docs/fast-path.md#int8-drafter).
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int,
                 pack: Callable[[torch.Tensor], torch.Tensor | None] = pack_weight) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.pack = pack  # (Vp, H) rows -> their oneDNN-packed copy, or None where packing would not pay
        self.register_buffer("draft_vocab_ids", torch.arange(draft_vocab_size))  # (Vp,) long
        self._weight: torch.Tensor | None = None  # (V, H) the target's head, detached, not registered
        self._rows: torch.Tensor | None = None  # (Vp, H) cached restricted rows
        self._floating: StoredWeight | None = None  # `_rows` (prepacked for oneDNN where it can), on first use
        self._int8_kind: tuple[torch.dtype, str] | None = None  # compute dtype and kernel, once store_int8 ran
        self._int8: StoredWeight | None = None  # `int8_weight` of the rows
        self.register_load_state_dict_post_hook(lambda module, _: module._refresh())

    def attach(self, lm_head_weight: torch.Tensor) -> None:
        """Use the target's LM head weight (V, H); it stays the target's (detached, never trained)."""
        if lm_head_weight.shape[0] != self.vocab_size:
            raise ValueError(f"LM head has {lm_head_weight.shape[0]} rows, the drafter expects V={self.vocab_size}")
        self._weight = lm_head_weight.detach()
        self._refresh()

    def set_vocab(self, ids: torch.Tensor) -> None:
        """Replace the draft vocabulary with `ids` (Vp,), distinct ids in 0..V-1."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        vp = self.draft_vocab_ids.shape[0]
        if ids.shape != (vp,) or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must be ({vp},) in 0..{self.vocab_size - 1}, "
                             f"got shape {tuple(ids.shape)}")
        if ids.unique().numel() != vp:
            raise ValueError("draft vocabulary ids must be distinct")
        self.draft_vocab_ids.copy_(ids)
        self._refresh()

    def store_int8(self, compute_dtype: torch.dtype, kernel: str) -> None:
        """Draft with the restricted rows rounded to int8 (one scale per row), multiplied by hspec's `kernel`
        ("int8" or "w8a8", `models.formats.store.int8_weight`; loaded: `models.native.load_kernels`), or as w4a8
        tiles ("w4a8"). The floating rows are kept."""
        self._int8_kind = (compute_dtype, kernel)
        self._refresh()

    def _refresh(self) -> None:
        if self._weight is not None:
            self._rows = in_fast_layout(self._weight[self.draft_vocab_ids.to(self._weight.device)])
            if self._int8_kind is not None and int8_kernel_fits(self._rows):
                self._int8 = int8_weight(self._rows, *self._int8_kind)
        self._floating = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, K, H) -> logits (N, K, Vp)."""
        if self._rows is None:
            raise RuntimeError("the pruned vocabulary head has no LM head attached; call attach() first")
        if hidden.requires_grad or hidden.dtype != self._rows.dtype:  # training (a backward) or autocast
            return F.linear(hidden, self._rows.to(hidden.dtype))  # (N, K, H) x (Vp, H)^T
        return self.inference_weight(hidden.dtype)(hidden)

    def inference_weight(self, dtype: torch.dtype) -> StoredWeight:
        """What an inference forward of `dtype` rows multiplies: the restricted rows (Vp, H) as int8 where
        `store_int8` ran for `dtype`, else floating, packed for oneDNN on the first call outside a compiled
        graph where it can be."""
        if self._rows is None:
            raise RuntimeError("the pruned vocabulary head has no LM head attached; call attach() first")
        if self._int8 is not None and self._int8_kind is not None and self._int8_kind[0] == dtype:
            return self._int8
        if self._floating is None and not torch.compiler.is_compiling():
            packed = self.pack(self._rows)
            self._floating = StoredWeight(FLOATING if packed is None else FLOATING_PACKED, self._rows, None, packed)
        return self._floating if self._floating is not None else StoredWeight(FLOATING, self._rows, None, None)

    def inference_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`inference_weight`'s tensors, as the native proposal (drafters/hspec/native.py) multiplies them:
        the rows (Vp, H), their scales (int8) or None, and the copy a kernel reads or None."""
        stored = self.inference_weight(dtype)
        return stored.weight, stored.scale, stored.packed

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., Vp) probabilities -> (..., V), zero outside the draft vocabulary."""
        full = probs.new_zeros((*probs.shape[:-1], self.vocab_size))
        ids = self.draft_vocab_ids.expand(*probs.shape[:-1], -1)
        return full.scatter_(-1, ids, probs)

    def to_target_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (...) -> target token ids (...)."""
        return self.draft_vocab_ids[local]


PrunedVocab = PrunedVocabHead


class MarkovHead(nn.Module):
    """DSpark's first-order correction: logits_k += W2(W1[prev_k]) (paper §3.3.3).

    W1 is an embedding over the full target vocabulary (the previous token may be any token, e.g. the
    anchor or a teacher-forced ground truth), rank r; W2 (r, Vp) maps r -> Vp. W2 starts at zero, so
    an untrained head leaves the backbone's prediction unchanged. W2 is stored (r, Vp), not as an
    `nn.Linear` (Vp, r): drafting multiplies one row per sequence by it once per slot, and that
    vector-matrix product streams the row-major (r, Vp) matrix ~3x faster on CPU.

    `store_int8` adds an int8 copy of W2 (inference only, not saved) that drafting multiplies with
    instead: one slot's product reads a quarter of the bytes (bf16 (1, 256) x (256, 8192): 159 us,
    int8: 41 us here), and greedy drafting runs it K times in sequence. hspec's kernels can multiply it
    (on an AVX2-only CPU its int8 kernel took 87 us a slot against torch's 135 with bf16 rows).
    """

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.W1 = nn.Embedding(vocab_size, rank)
        self.W2 = nn.Parameter(torch.zeros(rank, draft_vocab_size))  # (r, Vp)
        nn.init.normal_(self.W1.weight, std=rank**-0.5)
        self._w2_int8: StoredWeight | None = None  # (Vp, r) W2^T as int8 rows or w4a8 tiles, by store_int8
        self._w2_dtype: torch.dtype | None = None  # the compute dtype store_int8 ran for

    def store_int8(self, compute_dtype: torch.dtype, kernel: str = "torch") -> None:
        """Draft with W2 rounded to int8 (one scale per draft-vocabulary column); W2 itself is kept.

        A rank the int8 kernel cannot take (`int8_kernel_fits`) keeps drafting with W2. `kernel`: which one
        multiplies it (`models.formats.store.int8_weight`: torch, or hspec's int8 or w8a8), or "w4a8": W2 as w4a8
        tiles (1.3 MB at r = 256 and Vp = 8,192 where int8 takes 2.1: one core's 2 MB L2 cache then keeps it
        between the K slots, which stream it in sequence).
        """
        if int8_kernel_fits(self.W2.t()):
            self._w2_int8 = int8_weight(self.W2.t(), compute_dtype, kernel)
            self._w2_dtype = compute_dtype

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens (N, K) long target ids -> logit corrections (N, K, Vp)."""
        low_rank = self.W1(prev_tokens)  # (N, K, r)
        w2 = self._w2_int8
        if w2 is not None and not low_rank.requires_grad and self._w2_dtype == low_rank.dtype:
            return w2(low_rank)  # (N, K, Vp)
        return low_rank @ self.W2  # (N, K, r) @ (r, Vp)

    def int8_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The int8 copy of W2 that rows of `dtype` are multiplied with (`store_int8`): rows (Vp, r), their
        scales, the kernel's copy or None; None where drafting multiplies W2 itself. The native proposal
        (drafters/hspec/native.py) multiplies the same."""
        w2 = self._w2_int8
        if w2 is None or self._w2_dtype != dtype:
            return None
        return w2.weight, w2.scale, w2.packed


