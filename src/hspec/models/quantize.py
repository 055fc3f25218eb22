"""int8 weight-only storage of the target's linear weights (`--dtype int8`).

Plain decoding of a small model on a CPU is bound by reading the weights: every token streams all of
them once (SmolLM2-135M in bf16: 212 MB of layer weights and a 56 MB LM head). Storing each linear
weight as int8 with one bf16 scale per output row halves those bytes; the product runs in
`aten._weight_int8pack_mm`, which dequantizes a tile at a time and multiplies it with the bf16
activations. Activations, the KV pool, norms, attention and every drafter stay bf16.

The weights change (each row is rounded to 255 levels), so int8 is a different runtime from bf16: its
greedy output is compared with int8 plain decoding, never with bf16's. The int8 product computes each
row the same way however many rows share the call (checked by the losslessness tests), so a verify
and a 1-token decode agree bit for bit. A prompt's prefill is the one exception: it multiplies the
weights dequantized for the call, which is faster for hundreds of rows (`models.layers.linear`,
docs/fast-path.md#prefill).

Legend: N output features, K input features.

The kernel needs K to be a multiple of `_K_MULTIPLE` (torch 2.13 on x86 returns wrong numbers or
crashes for K = 24); a weight with another K stays floating.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.models.layers import Linear, QKVProjection, SwiGLU

_K_MULTIPLE = 16


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) floating weight -> (N, K) int8 contiguous and (N,) scales, weight ~= int8 * scale[:, None].

    Symmetric per output row: scale = max |w| / 127, so every row uses the full int8 range.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(scale_dtype)


def quantize_int8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Store every linear weight under `model`, and the stacked q/k/v and gate/up matrices, as int8.

    Plain `nn.Linear` children are first swapped for `models.layers.Linear` (same parameters), whose
    forward knows int8. Call after `fuse_projections`: a stacked matrix is quantized once and the named
    weights that were views of it become views of the int8 matrix and its scales (memory is not
    doubled; `state_dict()` keeps its names). A weight shared with an embedding (a tied LM head) is
    copied: the embedding keeps its floating rows for lookups. Frozen modules only.
    """
    _swap_plain_linears(model)
    for module in model.modules():
        if isinstance(module, QKVProjection) and module.qkv_weight is not None and int8_kernel_fits(module.qkv_weight):
            module.qkv_weight, module.qkv_scale = _requantize_views(
                module.qkv_weight, (module.q_proj, module.k_proj, module.v_proj), compute_dtype)
        elif (isinstance(module, SwiGLU) and module.gate_up_weight is not None
              and int8_kernel_fits(module.gate_up_weight)):
            module.gate_up_weight, module.gate_up_scale = _requantize_views(
                module.gate_up_weight, (module.gate_proj, module.up_proj), compute_dtype)
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype != torch.int8 and int8_kernel_fits(module.weight):
            _check_frozen(module.weight)
            q, scale = quantize_rows(module.weight, compute_dtype)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.weight_scale = scale


def _swap_plain_linears(model: nn.Module) -> None:
    """Replace every plain `nn.Linear` under `model` with a `Linear` holding the same parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                swapped = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                swapped.weight, swapped.bias = child.weight, child.bias
                setattr(parent, name, swapped)


def int8_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the int8 kernel takes this (N, K) weight's input width K (see the module doc)."""
    return weight.shape[1] % _K_MULTIPLE == 0


def _requantize_views(stacked: torch.Tensor, parts: tuple[Linear, ...], compute_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a stacked (sum of N, K) matrix and point each part's weight/scale at its rows."""
    for part in parts:
        _check_frozen(part.weight)
    q, scale = quantize_rows(stacked, compute_dtype)
    offset = 0
    for part in parts:
        rows = part.weight.shape[0]
        part.weight = nn.Parameter(q[offset : offset + rows], requires_grad=False)
        part.weight_scale = scale[offset : offset + rows]
        offset += rows
    return q, scale


def _check_frozen(weight: torch.Tensor) -> None:
    if weight.requires_grad:
        raise ValueError("quantize_int8 is for frozen inference modules; call requires_grad_(False) first")
