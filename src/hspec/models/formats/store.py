"""Store a model's linear weights in a format, chosen once at load: the one place that picks a format.

`store_target_weights` is what `--dtype` means for a target's linears (`models.loading.build_model` calls
it); the `quantize_*` walkers and `prepack_bf16` are its steps, also used on drafters (`runtime`).

Every walker visits the three holders of linear weights (`models.layers`): a `Linear` (weight, bias,
weight_scale, weight_packed, weight_format) and the stacked q/k/v and gate/up matrices of a
`QKVProjection` and a `SwiGLU` (qkv_* and gate_up_*, once `fuse_projections` ran). A stacked matrix is
stored once and the named weights that were views of it become views of what it stored (memory is not
doubled; `state_dict()` keeps its names); those parts are never multiplied once stacked. A weight shared
with an embedding (a tied LM head) is copied: the embedding keeps its floating rows for lookups. Frozen
modules only.

Legend: N output features, K input features.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from hspec.models.formats.base import StoredWeight, WeightFormat
from hspec.models.formats.floating import FLOATING, Floating, store_floating
from hspec.models.formats.int4 import INT4_HSPEC, INT4_TORCH, int4_kernel_fits
from hspec.models.formats.int8 import int8_format, int8_kernel_fits
from hspec.models.formats.w4a8 import W4A8_FORMAT, W8A8_FORMAT, w8a8_fits
from hspec.models.layers import Linear, QKVProjection, SwiGLU
from hspec.models.llama import TargetModel

# A floating (N, K) weight and whether hspec's kernels run -> the format it is stored in.
Chooser = Callable[[torch.Tensor, bool], WeightFormat]


def _int4(weight: torch.Tensor, kernels: bool) -> WeightFormat:
    return INT4_HSPEC if kernels else INT4_TORCH


def _w4a8(weight: torch.Tensor, kernels: bool) -> WeightFormat:
    return W4A8_FORMAT


def _w8a8(weight: torch.Tensor, kernels: bool) -> WeightFormat:
    """The w8a8 kernel where it takes the shape, else an int8 kernel (hspec's where it takes K)."""
    return W8A8_FORMAT if kernels and w8a8_fits(weight) else int8_format(weight, kernels)


def _w4a8_or_w8a8(weight: torch.Tensor, kernels: bool) -> WeightFormat:
    return W4A8_FORMAT if int4_kernel_fits(weight) else _w8a8(weight, kernels)


def store_target_weights(model: TargetModel, dtype: str | torch.dtype, compute_dtype: torch.dtype,
                         kernels: bool) -> None:
    """A target's linears as `--dtype` asks (after `fuse_projections`): "w4a8" the decoder layers' int4
    weights in w4a8 tiles and every other linear in w8a8's; "int4" the decoder layers' as int4 where the
    kernel takes them, every other one int8; "int8" every linear int8; a floating dtype keeps them floating,
    with oneDNN's copies for bf16 on a CPU. `kernels`: hspec's CPU kernels run (`models.native.load_kernels`)."""
    if dtype == "w4a8":
        quantize_w4a8(model, compute_dtype)
    elif dtype == "int4":
        if not quantize_int4(model.layers, compute_dtype, kernels):
            warnings.warn(f"--dtype int4: no linear of this {model.config.architecture} fits the int4 kernel "
                          "(inputs a multiple of 32, outputs of 16); it runs as int8", stacklevel=3)
        quantize_int8(model, compute_dtype, kernels)
    elif dtype == "int8":
        quantize_int8(model, compute_dtype, kernels)
    else:
        prepack_bf16(model)


def quantize_int8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, kernels: bool = False) -> int:
    """Every floating linear weight under `model` that an int8 kernel takes (`int8_kernel_fits`) as int8
    rows with a scale each (`formats.int8`); plain `nn.Linear` children become `Linear`s first. `kernels`:
    hspec's int8 kernel multiplies them where it takes K, else torch's. Returns how many were stored."""
    return _store(model, int8_format, int8_kernel_fits, compute_dtype, kernels)


def quantize_int4(layers: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, kernels: bool = False) -> int:
    """The linear weights under `layers` (a target's decoder layers) that the int4 kernels take as int4
    groups (`formats.int4`); `quantize_int8` stores the others (and the LM head) afterwards. `kernels`:
    hspec's int4 kernel multiplies them, else torch's. Returns how many weights became int4."""
    return _store(layers, _int4, int4_kernel_fits, compute_dtype, kernels)


def quantize_w4a8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """`--dtype w4a8`: the decoder layers' linears that the int4 kernels take as w4a8 tiles (`formats.w4a8`),
    then every other linear, the LM head among them, as `quantize_w8a8` stores them. Needs hspec's CPU
    kernels loaded (`models.native.load_kernels`)."""
    _store(model.layers, _w4a8, int4_kernel_fits, compute_dtype, True)
    quantize_w8a8(model, compute_dtype)


def quantize_drafter_w4a8(drafter: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """`--drafter-precision w4a8`: every floating linear weight under `drafter` that the int4 kernels take as
    w4a8 tiles (as `quantize_w4a8` stores a target's layers), the rest as `quantize_w8a8` stores them. Needs
    hspec's CPU kernels loaded (`models.native.load_kernels`)."""
    _store(drafter, _w4a8, int4_kernel_fits, compute_dtype, True)
    quantize_w8a8(drafter, compute_dtype)


def quantize_w8a8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Every floating linear weight under `model` (a w4a8 target's, a drafter's under it) as int8 rows for the
    w8a8 kernel (each product's input rows rounded to int8 blocks, integer products), or for hspec's int8
    kernel where the w8a8 one does not take the shape. Needs hspec's CPU kernels loaded."""
    _store(model, _w8a8, int8_kernel_fits, compute_dtype, True)


def int8_weight(weight: torch.Tensor, compute_dtype: torch.dtype, kernel: str) -> StoredWeight:
    """One (N, K) floating weight held outside a linear module as int8 rows: `kernel` "torch"
    (aten._weight_int8pack_mm), "int8" (hspec's int8 kernel where it takes K), "w8a8" (hspec's w8a8 kernel
    where it takes the shape, else its int8 one); or "w4a8": int4 groups in the w4a8 kernel's tiles where it
    takes the shape (as `quantize_w4a8` stores them), else as "w8a8"."""
    if kernel not in ("torch", "int8", "w8a8", "w4a8"):
        raise ValueError(f"unknown int8 kernel {kernel!r}; allowed: torch, int8, w8a8, w4a8")
    choose: Chooser = {"w4a8": _w4a8_or_w8a8, "w8a8": _w8a8}.get(kernel, int8_format)
    return choose(weight, kernel != "torch").store(weight, compute_dtype)


def prepack_bf16(model: nn.Module) -> None:
    """Give every bf16 product under `model` a oneDNN-prepacked weight (`formats.floating`): the stacked
    q/k/v and gate/up matrices and every other floating `Linear` (the named parts of a stacked matrix are
    not used and stay unpacked). Frozen inference modules on a CPU; elsewhere every weight stays on F.linear."""
    fused_parts: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QKVProjection) and module.qkv_weight is not None and _floating(module.qkv_format):
                fused_parts.update(id(m) for m in (module.q_proj, module.k_proj, module.v_proj))
                module.qkv_format, _, _, module.qkv_packed = store_floating(module.qkv_weight)
            elif isinstance(module, SwiGLU) and module.gate_up_weight is not None and _floating(module.gate_up_format):
                fused_parts.update(id(m) for m in (module.gate_proj, module.up_proj))
                module.gate_up_format, _, _, module.gate_up_packed = store_floating(module.gate_up_weight)
        for module in model.modules():
            if isinstance(module, Linear) and id(module) not in fused_parts and _floating(module.weight_format):
                if module.weight.requires_grad:
                    raise ValueError("prepack_bf16 is for frozen inference modules; call requires_grad_(False) first")
                module.weight_format, _, _, module.weight_packed = store_floating(module.weight)


def drop_packed(model: nn.Module) -> None:
    """Undo `prepack_bf16`: every floating product under `model` goes back to F.linear on the plain weights
    (the same bits; `hspec bench decode` times both)."""
    for module in model.modules():
        if isinstance(module, QKVProjection) and _floating(module.qkv_format):
            module.qkv_format, module.qkv_packed = FLOATING, None
        elif isinstance(module, SwiGLU) and _floating(module.gate_up_format):
            module.gate_up_format, module.gate_up_packed = FLOATING, None
        elif isinstance(module, Linear) and _floating(module.weight_format):
            module.weight_format, module.weight_packed = FLOATING, None


def _floating(weight_format: WeightFormat) -> bool:
    return isinstance(weight_format, Floating)


def _store(model: nn.Module, choose: Chooser, fits: Callable[[torch.Tensor], bool], compute_dtype: torch.dtype,
           kernels: bool) -> int:
    """Every floating weight under `model` that `fits` its kernels, in the format `choose` picks for it.
    Returns how many weights (stacked ones counted once) were stored."""
    _swap_plain_linears(model)
    stored = 0
    for module in model.modules():
        if (isinstance(module, QKVProjection) and module.qkv_weight is not None and _floating(module.qkv_format)
                and fits(module.qkv_weight)):
            module.qkv_format, module.qkv_weight, module.qkv_scale, module.qkv_packed = _store_stacked(
                module.qkv_weight, (module.q_proj, module.k_proj, module.v_proj), choose, compute_dtype, kernels)
            stored += 1
        elif (isinstance(module, SwiGLU) and module.gate_up_weight is not None and _floating(module.gate_up_format)
              and fits(module.gate_up_weight)):
            module.gate_up_format, module.gate_up_weight, module.gate_up_scale, module.gate_up_packed = _store_stacked(
                module.gate_up_weight, (module.gate_proj, module.up_proj), choose, compute_dtype, kernels)
            stored += 1
    for module in model.modules():
        if isinstance(module, Linear) and module.weight_scale is None and fits(module.weight):
            _check_frozen(module.weight)
            weight_format = choose(module.weight, kernels)
            module.weight_format, q, module.weight_scale, module.weight_packed = weight_format.store(
                module.weight, compute_dtype)
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


def _store_stacked(stacked: torch.Tensor, parts: tuple[Linear, ...], choose: Chooser, compute_dtype: torch.dtype,
                   kernels: bool) -> StoredWeight:
    """Store a stacked (sum of N, K) matrix and point each part's weight and scale at its rows; returns what
    the stacked matrix stored (the parts, never multiplied once stacked, get no kernel copy)."""
    for part in parts:
        _check_frozen(part.weight)
    stored = choose(stacked, kernels).store(stacked, compute_dtype)
    axis = stored.format.scale_rows_axis
    offset = 0
    for part in parts:
        rows = part.weight.shape[0]
        part.weight = nn.Parameter(stored.weight[offset : offset + rows], requires_grad=False)
        part.weight_scale = stored.scale.narrow(axis, offset, rows)
        offset += rows
    return stored


def _check_frozen(weight: torch.Tensor) -> None:
    if weight.requires_grad:
        raise ValueError("weight-only quantization is for frozen inference modules; call requires_grad_(False) first")

