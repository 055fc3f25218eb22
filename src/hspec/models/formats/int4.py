"""int4 weights in groups of 32 inputs, each group with its own step and minimum (`--dtype int4`).

The asymmetric scheme of llama.cpp's Q4_1 (`quantize_groups`): the default GGUF stores its layer weights
in Q4_1 blocks of 32, so requantized they give back the GGUF's own 4-bit levels, with steps and zeros
rounded to bf16 (docs/fast-path.md#int4-weight-only). The product runs in hspec's int4 kernel on the
levels packed for it (`INT4_HSPEC`, `pack_int4`, models/cpu_kernels.cpp, a CPU with AVX2 and FMA) or in
`aten._weight_int4pack_mm_for_cpu` on torch's packing (`INT4_TORCH`), a row with the same bits however
many rows share the call. `weight` itself holds the levels' floating values, which a prompt's prefill
multiplies at bf16's speed (dequantizing for each prefill cost ~75 ms). Only the decoder layers' linears
are int4 (`formats.store.quantize_int4`): the LM head stays int8, because the logits of a vocabulary's 49k
rows are where 4 bits would cost the most (llama.cpp's own SmolLM2 GGUF keeps its tied head in Q8_0).

Memory: the packed levels (a quarter of bf16's bytes, what a decode reads) beside their bf16 values (what a
prefill reads; SmolLM2: 53 + 212 MB).

Legend: N output features, K input features, G = INT4_GROUP.
"""

from __future__ import annotations

import torch

from hspec.models.formats.base import StoredWeight, WeightFormat

# Inputs per int4 group: Q4_1's block, and the smallest group torch's kernel takes (32, 64, 128 or 256).
INT4_GROUP = 32
_INT4_N_MULTIPLE = 16


class Int4(WeightFormat):
    """weight (N, K) the levels' floating values in the compute dtype. For hspec's kernel (`INT4_HSPEC`)
    weight_packed holds the levels (N, K/G, G/2) uint8 and weight_scale (N, K/G, 2) the fp32 step and offset
    of every group (a weight is level * step + offset, computed in fp32); for torch's (`INT4_TORCH`) the
    levels in its (N, K/2) layout and the steps and zeros (K/G, N, 2) in the compute dtype (a weight is
    (level - 8) * step + zero)."""

    name = "int4"

    def __init__(self, hspec_kernel: bool) -> None:
        self.hspec_kernel = hspec_kernel
        self.scale_rows_axis = 0 if hspec_kernel else 1

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        if self.hspec_kernel:
            out = torch.ops.hspec.int4_linear(flat, packed, scale)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), packed,
                                                              weight.shape[1] // scale.shape[0], scale)
        return out if bias is None else out + bias

    def store(self, weight: torch.Tensor, compute_dtype: torch.dtype) -> StoredWeight:
        """A floating (N, K) weight as its levels' floating values, and the scales and packed levels of
        hspec's kernel (`pack_int4`) or of torch's."""
        levels, scale = quantize_groups(weight, compute_dtype)
        floating = dequantize_groups(levels, scale, compute_dtype)
        if self.hspec_kernel:
            step_offset, packed = pack_int4(levels, scale)
            return StoredWeight(self, floating, step_offset, packed)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)  # (N, K/2) uint8
        return StoredWeight(self, floating, scale, packed)


INT4_TORCH = Int4(hspec_kernel=False)
INT4_HSPEC = Int4(hspec_kernel=True)


def quantize_groups(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) floating weight -> (N, K) uint8 levels 0..15 and (K/G, N, 2) steps and zeros in `scale_dtype`,
    weight ~= (level - 8) * step + zero (torch's int4 kernel's form, `dequantize_groups`).

    Per group of G inputs: step = (max - min) / 15 and zero = min + 8 step, so the levels span the group's
    range (Q4_1's choice); both are rounded to `scale_dtype` first and each level is the nearest under the
    rounded pair, which keeps a Q4_1 checkpoint's own levels.
    """
    n, k = weight.shape
    w = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = w.amin(-1), w.amax(-1)  # (N, K/G)
    step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    zero = (low + 8 * step.float()).to(scale_dtype)
    levels = torch.round((w - zero.float()[..., None]) / step.float()[..., None]) + 8
    scale = torch.stack((step, zero), dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
    return levels.clamp(0, 15).to(torch.uint8).view(n, k), scale


def dequantize_groups(levels: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int4 levels (N, K) with steps and zeros (K/G, N, 2) -> the (N, K) weights in `dtype`, bit for bit
    what the int4 kernels multiply: level * step + (zero - 8 step) in fp32, rounded once."""
    n, k = levels.shape
    groups = scale.shape[0]
    step, zero = scale.permute(1, 0, 2).float().contiguous().unbind(-1)  # (N, K/G) each
    grouped = levels.view(n, groups, k // groups).float()
    return torch.addcmul((zero - 8 * step)[..., None], grouped, step[..., None]).reshape(n, k).to(dtype)


def pack_int4(levels: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels (N, K) and steps and zeros (K/G, N, 2) (`quantize_groups`) -> hspec's int4 kernel's step and
    offset (N, K/G, 2) fp32, offset = zero - 8 step (`dequantize_groups`'s fp32 form, a weight being
    level * step + offset), and its levels (N, K/G, G/2) uint8: byte i of a group holds input i in its low
    nibble and input i + G/2 in its high one (models/cpu_kernels.cpp)."""
    n, k = levels.shape
    step, zero = scale.permute(1, 0, 2).float().unbind(-1)  # (N, K/G) each
    grouped = levels.view(n, k // INT4_GROUP, INT4_GROUP)
    packed = grouped[..., : INT4_GROUP // 2] | (grouped[..., INT4_GROUP // 2 :] << 4)
    return torch.stack((step, zero - 8 * step), dim=-1).contiguous(), packed.contiguous()


def int4_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the int4 kernels take this (N, K) weight: K a multiple of G, N of 16; a weight they cannot
    take is stored as int8."""
    return weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % _INT4_N_MULTIPLE == 0
