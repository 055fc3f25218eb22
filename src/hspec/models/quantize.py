"""Quantized storage of the target's linear weights: int8 (`--dtype int8`), int4 (`--dtype int4`) or int4
with int8 activations (`--dtype w4a8`).

Plain decoding of a small model on a CPU is bound by reading the weights: every token streams all of
them once (SmolLM2-135M in bf16: 212 MB of layer weights and a 56 MB LM head). Fewer bytes per weight
are fewer bytes to read; activations, the KV pool, norms, attention and every drafter stay bf16.

- int8: one bf16 scale per output row (`quantize_rows`); the product runs in hspec's int8 kernel
  (`models/cpu_kernels.cpp`, on a CPU with AVX2 and FMA) or `aten._weight_int8pack_mm`, each of which
  dequantizes a tile at a time and multiplies it with the activations.
- int4: groups of `INT4_GROUP` inputs of a row, each with its own step and minimum (`quantize_groups`,
  the asymmetric scheme of llama.cpp's Q4_1); the product runs in hspec's int4 kernel on the levels
  packed for it (`pack_int4`, on a CPU with AVX2 and FMA) or in `aten._weight_int4pack_mm_for_cpu` on
  torch's packing, and the weight itself becomes their floating values (`dequantize_groups`),
  which a prompt's prefill multiplies at bf16's speed (dequantizing for each prefill cost ~75 ms).
  Only the decoder layers' linears (`quantize_int4`): the LM head stays int8, because the logits of a
  vocabulary's 49k rows are where 4 bits would cost the most (llama.cpp's own SmolLM2 GGUF keeps its
  token embedding, which is the tied LM head, in Q8_0). The default target's GGUF stores those layer
  weights in Q4_1 blocks of 32: requantized, they give back the GGUF's own 4-bit levels, so int4 runs the
  checkpoint's numbers with its steps and zeros rounded to bf16 (docs/fast-path.md#int4-weight-only).

- w4a8: int4's levels, steps and zeros (the same weights), stored for hspec's w4a8 kernel (`pack_w4a8`, 8
  outputs' blocks side by side), and an int8 LM head stored for its w8a8 kernel (`pack_w8a8`); both kernels
  round each input row to int8 blocks of 32 (a step max|x| / 127 per block, as llama.cpp's Q8_1) and
  multiply in integers (`maddubs`: 32 products summed exactly per block), about twice as fast as the
  weight-only kernels for a decode's one row. The input rounding changes the numbers again (the rounding
  of one row never depends on the other rows). Only with hspec's kernels (x86-64, AVX2 and FMA).

The weights change (each row or group is rounded to 255 or 16 levels), so int8, int4 and w4a8 are runtimes
of their own: a greedy output is compared with plain decoding of the same dtype, never with bf16's. Both
kernels compute each row the same way however many rows share the call (checked by the losslessness
tests and `scripts/check_row_invariance.py`), so a verify and a 1-token decode agree bit for bit. A
prompt's prefill is the one exception: it multiplies floating weights in one product, which is
faster for hundreds of rows (`models.layers.linear`, docs/fast-path.md#prefill).

Memory: an int8 target holds its linear weights once, in int8; an int4 one holds the packed levels (a
quarter of bf16's bytes, what a decode reads) beside their bf16 values (what a prefill reads; SmolLM2:
53 + 212 MB, a bf16 target with its oneDNN copies 424 MB).

Legend: N output features, K input features, G = INT4_GROUP.

The int8 kernel needs K to be a multiple of `_K_MULTIPLE` (torch 2.13 on x86 returns wrong numbers or
crashes for K = 24); the int4 kernel needs K a multiple of G and N a multiple of `_INT4_N_MULTIPLE`. A
weight the int4 kernel cannot take is stored as int8, one neither takes stays floating.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hspec.models.layers import Linear, QKVProjection, SwiGLU

_K_MULTIPLE = 16
# Inputs per int4 group: Q4_1's block, and the smallest group the kernel takes (32, 64, 128 or 256).
INT4_GROUP = 32
_INT4_N_MULTIPLE = 16
# Outputs whose blocks the w4a8 and w8a8 kernels read side by side (a multiple of it divides _INT4_N_MULTIPLE).
_W4A8_OUTPUTS = 8

# A weight (N, K), its compute dtype and whether hspec's kernels run it -> what `linear` takes: the stored
# weight, its scales, and the copy its kernel reads (None where torch's kernel reads the stored weight).
Quantizer = Callable[[torch.Tensor, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) floating weight -> (N, K) int8 contiguous and (N,) scales, weight ~= int8 * scale[:, None].

    Symmetric per output row: scale = max |w| / 127, so every row uses the full int8 range.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(scale_dtype)


def quantize_groups(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) floating weight -> (N, K) uint8 levels 0..15 and (K/G, N, 2) steps and zeros in `scale_dtype`,
    weight ~= (level - 8) * step + zero (the int4 kernel's form, `dequantize_groups`).

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
    what the int4 kernel multiplies: level * step + (zero - 8 step) in fp32, rounded once."""
    n, k = levels.shape
    groups = scale.shape[0]
    step, zero = scale.permute(1, 0, 2).float().contiguous().unbind(-1)  # (N, K/G) each
    grouped = levels.view(n, groups, k // groups).float()
    return torch.addcmul((zero - 8 * step)[..., None], grouped, step[..., None]).reshape(n, k).to(dtype)


def _int8(weight: torch.Tensor, compute_dtype: torch.dtype, kernels: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor | None]:
    """`Quantizer` of `quantize_int8`: int8 rows, their scales, and the matrix again where hspec's kernel
    multiplies it (`kernels`, inputs a multiple of `INT4_GROUP`), else None (torch's kernel)."""
    q, scale = quantize_rows(weight, compute_dtype)
    return q, scale, q if kernels and weight.shape[1] % INT4_GROUP == 0 else None


def _int4(weight: torch.Tensor, compute_dtype: torch.dtype, kernels: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """`Quantizer` of `quantize_int4`: the levels' floating values, and the scales and packed levels of
    hspec's kernel (`kernels`: `pack_int4`) or of torch's."""
    levels, scale = quantize_groups(weight, compute_dtype)
    floating = dequantize_groups(levels, scale, compute_dtype)
    if kernels:
        return (floating, *pack_int4(levels, scale))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)  # (N, K/2) uint8
    return floating, scale, packed


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


def _w4a8(weight: torch.Tensor, compute_dtype: torch.dtype, kernels: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """`Quantizer` of `quantize_w4a8`: int4's floating values and hspec step/offset pairs (`_int4`), and the
    w4a8 kernel's tiles (`pack_w4a8`) as the copy it reads."""
    levels, scale = quantize_groups(weight, compute_dtype)
    step_offset, _ = pack_int4(levels, scale)
    return dequantize_groups(levels, scale, compute_dtype), step_offset, pack_w4a8(levels, scale)


def pack_w4a8(levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Levels (N, K) and bf16 steps and zeros (K/G, N, 2) (`quantize_groups`) -> the w4a8 kernel's tiles
    (N/8, K/G, 160) uint8: for each 8 consecutive outputs and group, 128 bytes of levels (`_output_vectors`:
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
    step_zero = step_zero.view(n // _W4A8_OUTPUTS, _W4A8_OUTPUTS, 2, groups, 2).permute(0, 3, 2, 1, 4)
    return torch.cat([nibbles.reshape(n // _W4A8_OUTPUTS, groups, 128),
                      step_zero.reshape(n // _W4A8_OUTPUTS, groups, 4 * _W4A8_OUTPUTS)], dim=-1).contiguous()


def _output_vectors(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bytes -> (N/8, K/G, 8, 32): for each 8 outputs and group of G inputs, 8 vectors, vector q
    holding inputs 4q .. 4q + 3 of output j in bytes 4j .. 4j + 3 (the lanes of the w4a8 and w8a8
    kernels' products are outputs)."""
    n, k = weight.shape
    runs = weight.view(n // _W4A8_OUTPUTS, _W4A8_OUTPUTS, k // INT4_GROUP, INT4_GROUP // 4, 4)
    return runs.permute(0, 2, 3, 1, 4).reshape(n // _W4A8_OUTPUTS, k // INT4_GROUP, INT4_GROUP // 4,
                                               4 * _W4A8_OUTPUTS)


def _w8a8(weight: torch.Tensor, compute_dtype: torch.dtype, kernels: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor | None]:
    """`Quantizer` of `quantize_w4a8`'s int8 weights (the LM head): int8 rows and their scales, and the w8a8
    kernel's tiles (`pack_w8a8`) where it takes them (N a multiple of 8, K of G), else `_int8`'s copy."""
    if not (kernels and weight.shape[0] % _W4A8_OUTPUTS == 0 and weight.shape[1] % INT4_GROUP == 0):
        return _int8(weight, compute_dtype, kernels)
    q, scale = quantize_rows(weight, compute_dtype)
    return q, scale, pack_w8a8(q)


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """int8 rows (N, K) -> the w8a8 kernel's tiles (N/8, K/G, 8 G): per 8 outputs and group, the 8 vectors of
    `_output_vectors` (models/cpu_kernels.cpp, `w8a8_tile`)."""
    n, k = q.shape
    return _output_vectors(q).reshape(n // _W4A8_OUTPUTS, k // INT4_GROUP, _W4A8_OUTPUTS * INT4_GROUP).contiguous()


def int8_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the int8 kernel takes this (N, K) weight's input width K (see the module doc)."""
    return weight.shape[1] % _K_MULTIPLE == 0


def int4_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the int4 kernel takes this (N, K) weight (see the module doc)."""
    return weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % _INT4_N_MULTIPLE == 0


def quantize_int8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, kernels: bool = False) -> None:
    """Store every floating linear weight under `model`, and the stacked q/k/v and gate/up matrices, as int8.

    Plain `nn.Linear` children are first swapped for `models.layers.Linear` (same parameters), whose
    forward knows int8. Call after `fuse_projections` (and after `quantize_int4`, whose weights it leaves
    alone): a stacked matrix is quantized once and the named weights that were views of it become views
    of the int8 matrix and its scales (memory is not doubled; `state_dict()` keeps its names). A weight
    shared with an embedding (a tied LM head) is copied: the embedding keeps its floating rows for lookups.
    Frozen modules only. `kernels`: hspec's int8 kernel multiplies them (`models/cpu_kernels.cpp`, loaded:
    `models.native.build_extension`), else torch's.
    """
    _quantize(model, _int8, int8_kernel_fits, compute_dtype, kernels)


def quantize_int4(layers: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, kernels: bool = False) -> int:
    """Store the linear weights under `layers` (a target's decoder layers) that the int4 kernel takes as
    int4 groups (`quantize_groups`): the levels packed for the kernel, their steps and zeros, and the
    weight replaced by the levels' floating values; stacked matrices and views as in `quantize_int8`.
    Returns how many weights became int4; `quantize_int8` stores the others (and the LM head) afterwards.
    `kernels`: hspec's int4 kernel multiplies them (`pack_int4`), else torch's."""
    return _quantize(layers, _int4, int4_kernel_fits, compute_dtype, kernels)


def quantize_w4a8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """`--dtype w4a8`: the decoder layers' linears that the int4 kernel takes as int4 groups stored for the
    w4a8 kernel (`pack_w4a8`, each weight replaced by its levels' floating values for prefills, as int4),
    then every other linear, the LM head among them, as `quantize_w8a8` stores them. Needs hspec's CPU
    kernels loaded (`models.native.load_kernels`)."""
    _quantize(model.layers, _w4a8, int4_kernel_fits, compute_dtype, True)
    quantize_w8a8(model, compute_dtype)


def quantize_drafter_w4a8(drafter: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """`--drafter-precision w4a8`: every floating linear weight under `drafter` that the int4 kernel takes as
    int4 groups stored for the w4a8 kernel (as `quantize_w4a8` stores a target's layers), the rest as
    `quantize_w8a8` stores them. Needs hspec's CPU kernels loaded (`models.native.load_kernels`)."""
    _quantize(drafter, _w4a8, int4_kernel_fits, compute_dtype, True)
    quantize_w8a8(drafter, compute_dtype)


def quantize_w8a8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Every floating linear weight under `model` (a w4a8 target's, a drafter's under it) as int8 rows for the
    w8a8 kernel (`pack_w8a8`: each product's input rows rounded to int8 blocks, integer products), or for
    hspec's int8 kernel where the w8a8 one does not take the shape; stacked matrices as in `quantize_int8`.
    Needs hspec's CPU kernels loaded (`models.native.load_kernels`)."""
    _quantize(model, _w8a8, int8_kernel_fits, compute_dtype, True)


def int8_weight(weight: torch.Tensor, compute_dtype: torch.dtype, kernel: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor | None]:
    """One (N, K) floating weight as int8 rows, their scales and the copy a kernel reads (`models.layers.linear`
    takes all three): `kernel` "torch" (aten._weight_int8pack_mm, no copy), "int8" (hspec's int8 kernel),
    "w8a8" (hspec's w8a8 kernel where it takes the shape, else its int8 one), "w4a8" (int4 groups for
    hspec's w4a8 kernel where it takes the shape, as `quantize_w4a8` stores them: the levels' floating values,
    their steps and offsets, the tiles; else as "w8a8")."""
    if kernel not in ("torch", "int8", "w8a8", "w4a8"):
        raise ValueError(f"unknown int8 kernel {kernel!r}; allowed: torch, int8, w8a8, w4a8")
    if kernel == "w4a8":
        return (_w4a8 if int4_kernel_fits(weight) else _w8a8)(weight, compute_dtype, True)
    return (_w8a8 if kernel == "w8a8" else _int8)(weight, compute_dtype, kernel != "torch")


def _quantize(model: nn.Module, quantizer: Quantizer, fits: Callable[[torch.Tensor], bool],
              compute_dtype: torch.dtype, kernels: bool) -> int:
    """`quantize_int8` or `quantize_int4`: every weight under `model` not quantized yet (no scales) that
    `fits` the kernel. Returns how many weights (stacked ones counted once) were stored."""
    _swap_plain_linears(model)
    stored = 0
    for module in model.modules():
        if (isinstance(module, QKVProjection) and module.qkv_weight is not None and module.qkv_scale is None
                and fits(module.qkv_weight)):
            module.qkv_weight, module.qkv_scale, module.qkv_packed = _requantize_views(
                module.qkv_weight, (module.q_proj, module.k_proj, module.v_proj), quantizer, compute_dtype, kernels)
            stored += 1
        elif (isinstance(module, SwiGLU) and module.gate_up_weight is not None and module.gate_up_scale is None
              and fits(module.gate_up_weight)):
            module.gate_up_weight, module.gate_up_scale, module.gate_up_packed = _requantize_views(
                module.gate_up_weight, (module.gate_proj, module.up_proj), quantizer, compute_dtype, kernels)
            stored += 1
    for module in model.modules():
        if isinstance(module, Linear) and module.weight_scale is None and fits(module.weight):
            _check_frozen(module.weight)
            q, module.weight_scale, module.weight_packed = quantizer(module.weight, compute_dtype, kernels)
            module.weight = nn.Parameter(q, requires_grad=False)
            stored += 1
    return stored


def _swap_plain_linears(model: nn.Module) -> None:
    """Replace every plain `nn.Linear` under `model` with a `Linear` holding the same parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                swapped = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                swapped.weight, swapped.bias = child.weight, child.bias
                setattr(parent, name, swapped)


def _requantize_views(stacked: torch.Tensor, parts: tuple[Linear, ...], quantizer: Quantizer,
                      compute_dtype: torch.dtype, kernels: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize a stacked (sum of N, K) matrix and point each part's weight/scale at its rows; returns the
    stacked weight, scales and kernel copy (the parts, never multiplied once stacked, get none)."""
    for part in parts:
        _check_frozen(part.weight)
    q, scale, packed = quantizer(stacked, compute_dtype, kernels)
    torch_int4 = packed is not None and packed.dtype == torch.uint8 and packed.dim() == 2
    row_axis = 1 if torch_int4 else 0  # torch's int4 scales are (K/G, N, 2); int8's (N,), hspec's int4 (N, K/G, 2)
    offset = 0
    for part in parts:
        rows = part.weight.shape[0]
        part.weight = nn.Parameter(q[offset : offset + rows], requires_grad=False)
        part.weight_scale = scale.narrow(row_axis, offset, rows)
        offset += rows
    return q, scale, packed


def _check_frozen(weight: torch.Tensor) -> None:
    if weight.requires_grad:
        raise ValueError("weight-only quantization is for frozen inference modules; call requires_grad_(False) first")
