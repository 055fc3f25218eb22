"""One preallocated, paged KV store shared by every sequence and every layer.

The pool holds K and V for `num_target_layers + num_drafter_layers` layers in fixed-size pages of
`page_size` token slots. A sequence owns a page table (a list of page ids); token position `t` of a
sequence lives in slot `table[t // page_size] * page_size + t % page_size` of every layer. Target
layers come first; a drafter that keeps its own context KV (DFlash, DSpark, P-Eagle) gets the layers
after them, so its memory comes out of the same budget and a capacity comparison is honest.

Legend: B batch, T new tokens, S context length, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """K and V bytes one token occupies over `num_layers` layers: L x 2 x Hkv x D x bytes."""
    return num_layers * 2 * num_kv_heads * head_dim * bytes_per_element


def widened(kv: torch.Tensor) -> torch.Tensor:
    """K or V (B, S, Hkv, D) of a pool as float32 (a bf16 value is exact in fp32): a copy laid out as the pool
    laid it out, each head's keys consecutive for a transposed pool's K (`PagedKVPool`'s transposed_k), so
    that a product over it gets the operands, and the bits, a float32 pool's view of the same values gives."""
    if kv.dtype == torch.float32:
        return kv
    if kv.stride(1) == 1 and kv.shape[1] > 1:  # K^T (D, S) of each head row-major: keep it so
        return kv.permute(0, 2, 3, 1).to(torch.float32, memory_format=torch.contiguous_format).permute(0, 3, 1, 2)
    return kv.to(torch.float32)


def pages_for(length: int, page_size: int) -> int:
    """KV pages of `page_size` token slots that hold `length` positions (ceiling division)."""
    return -(-length // page_size)


class PoolFullError(RuntimeError):
    """Raised when a reservation needs more free pages than the pool has; nothing was changed."""


@dataclass(frozen=True)
class LayerKV:
    """Read-only views of one layer's K and V slots, each (num_slots, Hkv, D), post-RoPE for K.

    These are views into the pool, not copies. Readers must not write to them: only the pool's
    owner (the target runtime, or a drafter for its own layers) writes, through `PagedKVPool.write`.
    """

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class SlotTable:
    """Where a batch's context lives in the pool.

    slots: (B, S) slot index of position s of each sequence (0 where s >= that sequence's length).
    lengths: (B,) number of valid positions per sequence.
    contiguous_start: for B == 1 whose positions occupy consecutive slots, the first slot, so
        readers can take a zero-copy slice; None otherwise.
    """

    slots: torch.Tensor
    lengths: torch.Tensor
    contiguous_start: int | None

    def valid_mask(self) -> torch.Tensor:
        """(B, S) True where position s < length."""
        positions = torch.arange(self.slots.shape[1], device=self.slots.device)
        return positions[None, :] < self.lengths[:, None]


class PagedKVPool:
    """Fixed-capacity paged KV store with per-sequence page tables, rollback and free."""

    def __init__(
        self,
        num_target_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        num_drafter_layers: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        transposed_k: bool = False,
        product_dtype: torch.dtype | None = None,
    ) -> None:
        """transposed_k: K lives in memory as (L_all, Hkv, D, slots), seen as the usual (L_all, slots, Hkv,
        D), so that one head's K^T over consecutive slots is a row-major (D, S) matrix the score product
        of the row-invariant attention (models/layers.py) reads in place instead of copying it out of a
        strided view (same bits; docs/fast-path.md); the fused attention of float32 and GPU models prefers
        K slot-major (`TargetModel.new_pool` chooses).

        product_dtype: the dtype torch products over the pool's K/V take them in, None for `dtype`: float32
        for a CPU target's bfloat16 pool, which hspec's attention kernel widens as it reads it
        (`TargetModel.kv_dtype`), so that a drafter reading it (`gather_window`) multiplies what it would
        over a float32 pool of the same values."""
        for name, value in (("num_target_layers", num_target_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_pages", num_pages), ("page_size", page_size)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if num_drafter_layers < 0:
            raise ValueError(f"num_drafter_layers must be >= 0, got {num_drafter_layers}")
        if product_dtype not in (None, dtype, torch.float32):
            raise ValueError(f"a {dtype} pool's K/V are multiplied in {dtype} or float32, not {product_dtype}")
        self.num_target_layers = num_target_layers
        self.num_drafter_layers = num_drafter_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.product_dtype = dtype if product_dtype is None else product_dtype
        num_layers = num_target_layers + num_drafter_layers
        num_slots = num_pages * page_size
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        if transposed_k:
            k_storage = torch.zeros((num_layers, num_kv_heads, head_dim, num_slots), dtype=dtype, device=device)
            self.k = k_storage.permute(0, 3, 1, 2)  # (L_all, slots, Hkv, D)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L_all, slots, Hkv, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views for reading, each (slots, Hkv, D), taken once: a decode reads every layer, and a
        # select costs a dispatch. `write` takes fresh ones, which autograd lets a drafter's K/V fill.
        self._layer_k = [self.k[i] for i in range(num_layers)]
        self._layer_v = [self.v[i] for i in range(num_layers)]
        # Ascending pop order keeps a lone sequence's pages consecutive, which lets B == 1 attention
        # read a slice instead of gathering; freed pages are pushed back and reused first.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._page_tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, num_target_layers: int, num_kv_heads: int,
                           head_dim: int, page_size: int = 16, num_drafter_layers: int = 0,
                           dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                           transposed_k: bool = False, product_dtype: torch.dtype | None = None) -> PagedKVPool:
        """As many pages as fit in `budget_bytes` for all layers (target + drafter); the other arguments as
        in `__init__`."""
        per_token = cls.bytes_per_token(num_target_layers + num_drafter_layers, num_kv_heads, head_dim, dtype)
        num_pages = budget_bytes // (per_token * page_size)
        if num_pages < 1:
            raise ValueError(
                f"memory budget {budget_bytes} B holds no page of {page_size} tokens "
                f"({per_token} B per token); raise the budget"
            )
        return cls(num_target_layers, num_kv_heads, head_dim, int(num_pages), page_size,
                   num_drafter_layers, dtype, device, transposed_k, product_dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes one token takes over `num_layers` layers at `dtype` (`kv_bytes_per_token`)."""
        return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())

    # ---- capacity -----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def utilization(self) -> float:
        """Pages in use / pages total."""
        return 1.0 - len(self._free_pages) / self.num_pages

    def pages_needed(self, seq_id: int, new_length: int) -> int:
        """Extra pages `seq_id` would need to hold `new_length` tokens (0 for an unknown id's none)."""
        held = len(self._page_tables.get(seq_id, ()))
        return max(0, pages_for(new_length, self.page_size) - held)

    def can_hold(self, seq_id: int, new_length: int) -> bool:
        return self.pages_needed(seq_id, new_length) <= len(self._free_pages)

    # ---- sequences ----------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._lengths:
            raise ValueError(f"sequence {seq_id} is already in the pool")
        self._page_tables[seq_id] = []
        self._lengths[seq_id] = 0

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._lengths

    def sequence_ids(self) -> list[int]:
        return list(self._lengths)

    def length(self, seq_id: int) -> int:
        return self._lengths[self._check(seq_id)]

    def lengths(self, seq_ids: Sequence[int]) -> list[int]:
        return [self._lengths[self._check(s)] for s in seq_ids]

    def extend(self, seq_ids: Sequence[int], num_new: int) -> torch.Tensor:
        """Append `num_new` positions to every sequence; returns their slots, (B, T).

        All-or-nothing: if the pool cannot hold every sequence's growth, raises PoolFullError and
        changes nothing.
        """
        needed = sum(self.pages_needed(s, self._lengths[self._check(s)] + num_new) for s in seq_ids)
        if needed > len(self._free_pages):
            raise PoolFullError(
                f"pool full: need {needed} pages for {len(seq_ids)} sequence(s), {len(self._free_pages)} free"
            )
        rows = []
        for s in seq_ids:
            start = self._lengths[s]
            table = self._page_tables[s]
            for _ in range(self.pages_needed(s, start + num_new)):
                table.append(self._free_pages.pop())
            self._lengths[s] = start + num_new
            rows.append([table[t // self.page_size] * self.page_size + t % self.page_size
                         for t in range(start, start + num_new)])
        return torch.tensor(rows, dtype=torch.long, device=self.k.device)

    def copy_sequence(self, source: int, dest: int) -> None:
        """Add `dest` holding a copy of `source`'s positions: pages of its own, every layer's K/V copied.

        All-or-nothing like `extend`: where the pool cannot hold the copy, raises PoolFullError and adds nothing.
        """
        length = self._lengths[self._check(source)]
        if dest in self._lengths:
            raise ValueError(f"sequence {dest} is already in the pool")
        if pages_for(length, self.page_size) > len(self._free_pages):
            raise PoolFullError(f"pool full: need {pages_for(length, self.page_size)} pages to copy sequence "
                                f"{source}, {len(self._free_pages)} free")
        self.add_sequence(dest)
        if not length:
            return
        into = self.extend([dest], length)[0]  # (S,)
        start = self.slot_table([source]).slots[0]  # (S,)
        for cache in (self.k, self.v):  # (L_all, slots, Hkv, D) each
            cache.index_copy_(1, into, cache.index_select(1, start))

    def truncate(self, seq_id: int, new_length: int) -> None:
        """Roll `seq_id` back to its first `new_length` positions and free pages no longer needed."""
        length = self._lengths[self._check(seq_id)]
        if not 0 <= new_length <= length:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {length} to {new_length}")
        table = self._page_tables[seq_id]
        keep = pages_for(new_length, self.page_size)
        while len(table) > keep:
            self._free_pages.append(table.pop())
        self._lengths[seq_id] = new_length

    def free(self, seq_id: int) -> None:
        """Release every page of `seq_id` and forget it."""
        self.truncate(seq_id, 0)
        del self._page_tables[seq_id], self._lengths[seq_id]

    # ---- reading and writing ------------------------------------------------------------------

    def slot_table(self, seq_ids: Sequence[int], length_override: int | None = None) -> SlotTable:
        """Slots of positions 0..S-1 of each sequence, S = the longest length (or `length_override`)."""
        lengths = [self._lengths[self._check(s)] for s in seq_ids]
        max_len = max(lengths) if length_override is None else length_override
        bs = self.page_size
        device = self.k.device
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        if len(seq_ids) == 1:
            table = self._page_tables[seq_ids[0]]
            n = pages_for(max_len, bs)
            if n and table[:n] == list(range(table[0], table[0] + n)):
                start = table[0] * bs
                slots = torch.arange(start, start + max_len, device=device)[None, :]
                return SlotTable(slots, lengths_t, start)
        width = max(1, pages_for(max_len, bs))
        tables = torch.zeros((len(seq_ids), width), dtype=torch.long, device=device)
        for row, s in enumerate(seq_ids):
            table = self._page_tables[s][:width]
            if table:
                tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        positions = torch.arange(max_len, device=device)
        slots = tables[:, positions // bs] * bs + positions % bs  # (B, S)
        slots = torch.where(positions[None, :] < lengths_t[:, None], slots, torch.zeros_like(slots))
        return SlotTable(slots, lengths_t, None)

    def consecutive_window(self, seq_id: int, window: int) -> tuple[int, int] | None:
        """(first slot, S) of the last S = min(length, window) positions of `seq_id` where they lie in consecutive
        slots, so that each layer's K/V of them is one view (`layer(i).k[first:first + S]`); None where they do
        not, or S = 0."""
        length = self._lengths[self._check(seq_id)]
        keys = min(length, window)
        if keys <= 0:
            return None
        table, page = self._page_tables[seq_id], self.page_size
        first, last = (length - keys) // page, (length - 1) // page
        start = table[first]
        if table[first:last + 1] != list(range(start, start + last - first + 1)):
            return None
        return start * page + (length - keys) % page, keys

    def layer(self, layer: int) -> LayerKV:
        """Read-only views of one layer's K/V (target layers 0..L-1, drafter layers after them)."""
        if not 0 <= layer < self.k.shape[0]:
            raise IndexError(f"layer {layer} is outside the pool's {self.k.shape[0]} layers")
        return LayerKV(self._layer_k[layer], self._layer_v[layer])

    def drafter_layer_index(self, i: int) -> int:
        """Pool layer index of the drafter's i-th own layer."""
        if not 0 <= i < self.num_drafter_layers:
            raise IndexError(f"drafter layer {i} outside the pool's {self.num_drafter_layers} drafter layers")
        return self.num_target_layers + i

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V, each (B, T, Hkv, D), at `slots` (B, T) of one layer."""
        flat = slots.reshape(-1)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            new = new.reshape(-1, self.num_kv_heads, self.head_dim)
            cache.index_copy_(0, flat, new if new.dtype == cache.dtype else new.to(cache.dtype))

    def gather(self, layer: int, table: SlotTable, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the table's positions, each (B, S', Hkv, D): a view when contiguous, else a gather.

        S' is the table's S rounded up to `multiple` where the pool can give the extra positions (always
        for a gather; for a view when the slots after the sequence's exist): a reader that weighs them 0
        may compute over S' keys without copying. They hold other slots' contents, which are finite (every
        slot holds zeros or K/V written to it); a gather reads slot 0 there, as for a shorter sequence's
        unused positions.
        """
        s, start = table.slots.shape[1], table.contiguous_start
        pad = -s % multiple
        if start is not None:
            return self._view(layer, start, start + s + pad if start + s + pad <= self.capacity_tokens else start + s)
        return self._gather(layer, F.pad(table.slots, (0, pad)) if pad else table.slots)

    def gather_window(self, layers: Sequence[int], seq_ids: Sequence[int], ends: Sequence[int], window: int,
                      multiple: int = 1, as_stored: bool = False
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """K and V of `layers` at the last min(end, window) positions before ends[b] of each sequence.

        Keys are right-aligned: key j of row b is position ends[b] - S + j, S = min(max(ends), window);
        keys at negative positions are masked. A lone sequence with consecutive pages gets views, as
        in `gather`. `multiple`: as in `gather`, S' = S rounded up to it where the pool has the slots, the
        keys after the S masked. Returns ([(k, v) each (B, S', Hkv, D)] in `layers` order, in
        `product_dtype` (copies where it is not the pool's dtype, `widened`), or in the pool's own dtype where
        `as_stored` (for a reader that widens each value as it loads it: hspec's block-attention kernel),
        visible (B, S') bool).
        """
        device = self.k.device
        if not layers:
            return [], torch.zeros((len(seq_ids), 0), dtype=torch.bool, device=device)
        max_len = max(ends)
        s = min(max_len, window)
        pad = -s % multiple
        table = self.slot_table(seq_ids)
        if table.contiguous_start is not None:
            start = table.contiguous_start + max_len - s
            if start + s + pad >= self.capacity_tokens:  # not to the pool's end: a compiled drafter guards on
                pad = 0  # whether its keys span the whole pool (K's stride is the slot count) and would recompile
            visible = torch.arange(s + pad, device=device)[None, :] < s  # (1, S')
            return [self._for_products(*self._view(i, start, start + s + pad), as_stored) for i in layers], visible
        ends_t = torch.as_tensor(list(ends), dtype=torch.long, device=device)
        positions = ends_t[:, None] - s + torch.arange(s + pad, device=device)  # (B, S')
        visible = (positions >= 0) & (positions < ends_t[:, None])
        slots = table.slots.gather(1, torch.where(visible, positions, 0))  # (B, S')
        return [self._for_products(*self._gather(i, slots), as_stored) for i in layers], visible

    def _for_products(self, k: torch.Tensor, v: torch.Tensor, as_stored: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V read from the pool, in `product_dtype` (as they are where `as_stored`)."""
        return (k, v) if as_stored or k.dtype == self.product_dtype else (widened(k), widened(v))

    def _view(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the consecutive slots start..end-1 of one layer, each (1, end - start, Hkv, D), as views."""
        return self._layer_k[layer][start:end].unsqueeze(0), self._layer_v[layer][start:end].unsqueeze(0)

    def _gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (B, S) of one layer, each (B, S, Hkv, D), copied out."""
        return self._layer_k[layer][slots], self._layer_v[layer][slots]

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._lengths:
            raise KeyError(f"sequence {seq_id} is not in the pool")
        return seq_id
