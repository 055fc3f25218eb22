"""Integer products with int8 activations (`--dtype w4a8`): int4 weights times int8 rows (`W4A8`, the
decoder layers) and int8 weights times int8 rows (`W8A8`, the LM head and a drafter's linears under it).

W4A8 stores int4's levels, steps and zeros (the same weights, `formats.int4`) as the w4a8 kernel's tiles
(`pack_w4a8`, 8 outputs' blocks side by side); W8A8 stores int8 rows (`formats.int8.quantize_rows`) as the
w8a8 kernel's tiles (`pack_w8a8`). Both kernels (models/cpu_kernels.cpp; hspec's only, x86-64 with AVX2
and FMA) round each input row to int8 blocks of 32 (a step max|x| / 127 per block, llama.cpp's Q8_1) and
multiply in integers (`maddubs`: 32 products summed exactly per block), about twice as fast as the
weight-only kernels for a decode's one row (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_1). The rounding of one
row never depends on the other rows, so a row keeps its bits however many share the call.

Legend: N output features, K input features, G = INT4_GROUP.
"""

from __future__ import annotations

import torch

from hspec.models.formats.base import StoredWeight, WeightFormat
from hspec.models.formats.int4 import INT4_GROUP, dequantize_groups, pack_int4, quantize_groups
from hspec.models.formats.int8 import quantize_rows

# Outputs whose blocks the w4a8 and w8a8 kernels read side by side (a multiple of it divides int4's 16).
_OUTPUTS = 8
# Bytes per 8 outputs and 32 inputs of a w4a8 weight: 128 of levels, 8 bf16 steps and 8 bf16 zeros (`pack_w4a8`).
W4A8_TILE_BYTES = 160


class W4A8(WeightFormat):
    """weight (N, K) the levels' floating values (what a prefill multiplies, as int4's), weight_scale
    (N, K/G, 2) hspec's int4 step and offset pairs, weight_packed the w4a8 tiles (N/8, K/G, 160) uint8."""

    name = "w4a8"

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.hspec.w4a8_linear(flat, packed)
        return out if bias is None else out + bias

    def store(self, weight: torch.Tensor, compute_dtype: torch.dtype) -> StoredWeight:
        levels, scale = quantize_groups(weight, compute_dtype)
        step_offset, _ = pack_int4(levels, scale)
        return StoredWeight(self, dequantize_groups(levels, scale, compute_dtype), step_offset,
                            pack_w4a8(levels, scale))


class W8A8(WeightFormat):
    """weight (N, K) int8, weight_scale (N,) in the compute dtype (int8's rows), weight_packed the w8a8
    tiles (N/8, K/G, 8 G) int8."""

    name = "w8a8"

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.hspec.w8a8_linear(flat, packed, scale)
        return out if bias is None else out + bias

    def floating_weight(self, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return weight.to(dtype) * scale[:, None]

    def store(self, weight: torch.Tensor, compute_dtype: torch.dtype) -> StoredWeight:
        q, scale = quantize_rows(weight, compute_dtype)
        return StoredWeight(self, q, scale, pack_w8a8(q))


W4A8_FORMAT = W4A8()
W8A8_FORMAT = W8A8()


def w8a8_fits(weight: torch.Tensor) -> bool:
    """Whether the w8a8 kernel takes this (N, K) weight: N a multiple of 8, K of G."""
    return weight.shape[0] % _OUTPUTS == 0 and weight.shape[1] % INT4_GROUP == 0


def pack_w4a8(levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Levels (N, K) and bf16 steps and zeros (K/G, N, 2) (`quantize_groups`) -> the w4a8 kernel's tiles
    (N/8, K/G, 160) uint8, pairs of tiles interleaved (`_pairs_interleaved`): for each 8 consecutive outputs
    and group, 128 bytes of levels (`_output_vectors`:
    4-byte input runs of the 8 outputs side by side; 32-byte chunk c holds vector 2c in its low nibbles and
    vector 2c + 1 in its high ones), then the 8 outputs' bf16 steps, then their bf16 zeros
    (models/cpu_kernels.cpp, `w4a8_tile`)."""
    n, k = levels.shape
    groups = k // INT4_GROUP
    vectors = _output_vectors(levels)  # (N/8, K/G, 8, 32)
    nibbles = vectors[:, :, 0::2] | (vectors[:, :, 1::2] << 4)  # (N/8, K/G, 4, 32)
    # (N, 2 K/G) bf16 -> (N, 2 K/G x 2 bytes); reshaped, not only made contiguous: with one group the permuted
    # last dim has size 1 and keeps a stride other than 1, which a view as bytes refuses
    step_zero = scale.to(torch.bfloat16).permute(1, 2, 0).reshape(n, 2 * groups).contiguous().view(torch.uint8)
    step_zero = step_zero.view(n // _OUTPUTS, _OUTPUTS, 2, groups, 2).permute(0, 3, 2, 1, 4)
    return _pairs_interleaved(torch.cat([nibbles.reshape(n // _OUTPUTS, groups, 128),
                                         step_zero.reshape(n // _OUTPUTS, groups, 4 * _OUTPUTS)], dim=-1))


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """int8 rows (N, K) -> the w8a8 kernel's tiles (N/8, K/G, 8 G), pairs of tiles interleaved
    (`_pairs_interleaved`): per 8 outputs and group, the 8 vectors of `_output_vectors` (models/cpu_kernels.cpp,
    `w8a8_tile`)."""
    n, k = q.shape
    return _pairs_interleaved(_output_vectors(q).reshape(n // _OUTPUTS, k // INT4_GROUP, _OUTPUTS * INT4_GROUP))


def _pairs_interleaved(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles (N/8, K/G, bytes), tile t's blocks in order -> the same (N/8, K/G, bytes) storage with each pair of
    tiles (2p, 2p + 1) interleaved block by block: tile 2p's block g, then tile 2p + 1's block g, then block g + 1.
    A last tile where N/8 is odd keeps its blocks in order. A product that reads both tiles of a pair (the
    VNNI tiles' 16 outputs) then reads one run of memory in order, as the hardware prefetchers follow it, not
    two runs K/G blocks apart (models/cpu_kernels.cpp, `TileBlocks`)."""
    paired = tiles.shape[0] // 2 * 2
    pairs = tiles[:paired].view(paired // 2, 2, *tiles.shape[1:]).transpose(1, 2).reshape(paired, *tiles.shape[1:])
    return torch.cat([pairs, tiles[paired:]]).contiguous()


def _output_vectors(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bytes -> (N/8, K/G, 8, 32): for each 8 outputs and group of G inputs, 8 vectors, vector q
    holding inputs 4q .. 4q + 3 of output j in bytes 4j .. 4j + 3 (the lanes of the w4a8 and w8a8
    kernels' products are outputs)."""
    n, k = weight.shape
    runs = weight.view(n // _OUTPUTS, _OUTPUTS, k // INT4_GROUP, INT4_GROUP // 4, 4)
    return runs.permute(0, 2, 3, 1, 4).reshape(n // _OUTPUTS, k // INT4_GROUP, INT4_GROUP // 4, 4 * _OUTPUTS)
