"""int8 weights, one scale per output row (`--dtype int8`; the LM head of int4; a drafter's int8 linears).

Plain decoding of a small model on a CPU is bound by reading the weights: every token streams all of them
once (SmolLM2-135M in bf16: 212 MB of layer weights and a 56 MB LM head), and int8 halves the bytes.
`quantize_rows` rounds each row symmetrically to 255 levels; the product runs in hspec's int8 kernel
(`INT8_HSPEC`, models/cpu_kernels.cpp, a CPU with AVX2 and FMA) or in `aten._weight_int8pack_mm`
(`INT8_TORCH`), each of which dequantizes a tile at a time and multiplies it with the bf16 rows, a row with
the same bits however many rows share the call. The weights change, so int8 is a runtime of its own: its
greedy output is compared with plain decoding in int8, never with bf16's.

torch's kernel needs K a multiple of `_K_MULTIPLE` (torch 2.13 on x86 returns wrong numbers or crashes
for K = 24), hspec's a multiple of 32; a weight neither takes stays floating.

Legend: M rows, N output features, K input features.
"""

from __future__ import annotations

import torch

from hspec.models.formats.base import StoredWeight, WeightFormat

_K_MULTIPLE = 16
# Inputs per block of hspec's int8 kernel (the int4 group's size).
_HSPEC_K_MULTIPLE = 32


class Int8(WeightFormat):
    """weight (N, K) int8, weight_scale (N,) in the compute dtype: w ~= int8 * scale[:, None];
    weight_packed the same int8 matrix again for hspec's kernel (`INT8_HSPEC`), None for torch's."""

    name = "int8"

    def __init__(self, hspec_kernel: bool) -> None:
        self.hspec_kernel = hspec_kernel

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        if self.hspec_kernel:  # compiled graphs call it too
            out = torch.ops.hspec.int8_linear(flat, packed, scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, weight, scale)
        return out if bias is None else out + bias

    def floating_weight(self, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return weight.to(dtype) * scale[:, None]

    def store(self, weight: torch.Tensor, compute_dtype: torch.dtype) -> StoredWeight:
        """A floating (N, K) weight as int8 rows and their scales (`quantize_rows`), and hspec's kernel's copy."""
        q, scale = quantize_rows(weight, compute_dtype)
        return StoredWeight(self, q, scale, q if self.hspec_kernel else None)


INT8_TORCH = Int8(hspec_kernel=False)
INT8_HSPEC = Int8(hspec_kernel=True)


def int8_format(weight: torch.Tensor, kernels: bool) -> Int8:
    """Which int8 kernel multiplies this (N, K) weight: hspec's where `kernels` run and it takes K, else torch's."""
    return INT8_HSPEC if kernels and weight.shape[1] % _HSPEC_K_MULTIPLE == 0 else INT8_TORCH


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) floating weight -> (N, K) int8 contiguous and (N,) scales, weight ~= int8 * scale[:, None].

    Symmetric per output row: scale = max |w| / 127, so every row uses the full int8 range.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(scale_dtype)


def int8_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether an int8 kernel takes this (N, K) weight's input width K (see the module doc)."""
    return weight.shape[1] % _K_MULTIPLE == 0
