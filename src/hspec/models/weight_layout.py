"""Memory layout of linear weights for inference on CPU: column-major storage and stacked projections.

`nn.Linear` keeps its weight as a row-major (out, in) matrix. On CPU an fp32 forward over several rows
at once (an 8-token verify, a prefill, a drafter's block) can run faster when the same (out, in) weight
is the transpose of a contiguous (in, out) matrix, the order in which the GEMM consumes it (measured 8%
and 4% at 4 and 8 rows, 2 threads, on an earlier host), and the fp32 LM head's one-row product 1.6x
faster. bf16 weights are the other way round: oneDNN's bf16 GEMM (AVX512-BF16) runs 1.1-1.2x faster
on row-major layer weights and 2x on the LM head, and SmolLM2's bf16 decode takes 26 ms a token instead
of 38 (1 thread; docs/fast-path.md). So only fp32 weights are re-stored; the others keep row-major.

The values never change, only their order in memory, so outputs are those of the row-major layout up
to the rounding of a different GEMM kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.models.layers import QKVProjection, SwiGLU


def in_fast_layout(weight: torch.Tensor) -> torch.Tensor:
    """An (out, in) matrix, same values, stored the way `F.linear` runs it fastest on CPU for its dtype:
    fp32 column-major (the transpose of a contiguous (in, out) matrix), other dtypes row-major."""
    if weight.dtype == torch.float32:
        return weight if weight.t().is_contiguous() else weight.t().contiguous().t()
    return weight.contiguous()


def store_linear_weights_in_fast_layout(module: nn.Module) -> None:
    """Re-store every `nn.Linear` weight under `module` in `in_fast_layout` (fp32 column-major, others
    row-major); weights already stored that way are left alone.
    A tensor shared with other modules stays shared: each distinct tensor is converted once, and every
    module whose `weight` was that tensor (another linear, or an embedding tied to an LM head) is
    pointed at the result. `requires_grad` is kept.
    """
    converted: dict[int, nn.Parameter] = {}
    for child in module.modules():
        weight = child.weight if isinstance(child, nn.Linear) else None
        if weight is not None and id(weight) not in converted:
            stored = in_fast_layout(weight.detach())
            if stored.data_ptr() != weight.data_ptr():
                converted[id(weight)] = nn.Parameter(stored, requires_grad=weight.requires_grad)
    for child in module.modules():
        weight = getattr(child, "weight", None)
        if isinstance(weight, nn.Parameter) and id(weight) in converted:
            child.weight = converted[id(weight)]


def fuse_projections(module: nn.Module) -> None:
    """Stack the q/k/v weights of every `QKVProjection` and the gate/up weights of every `SwiGLU` under
    `module` into one matrix each, so each runs as one GEMM (inference only).

    The separate weights become views into the stacked matrix: memory is not doubled, `state_dict()` keeps
    its names and values, and the stacked matrix keeps the layout of the originals (column-major if they
    were, see `store_linear_weights_in_fast_layout`). The outputs are those of the separate matmuls up to
    the GEMM kernel's rounding. Refused for trainable weights: a gradient would reach the stacked copy,
    not the named parameters.
    """
    for child in module.modules():
        if isinstance(child, QKVProjection) and child.qkv_weight is None:
            parts = (child.q_proj, child.k_proj, child.v_proj)
            child.qkv_weight = _stack_weights(parts)
            if child.q_proj.bias is not None:
                child.qkv_bias = _stack_biases(parts)
        elif isinstance(child, SwiGLU) and child.gate_up_weight is None:
            child.gate_up_weight = _stack_weights((child.gate_proj, child.up_proj))


def _stack_weights(linears: tuple[nn.Linear, ...]) -> torch.Tensor:
    """(sum of outs, in) stacked weight; each linear's weight becomes a view of its rows."""
    weights = [linear.weight.detach() for linear in linears]
    for linear in linears:
        if linear.weight.requires_grad:
            raise ValueError("fuse_projections is for frozen inference modules; call requires_grad_(False) first")
    if all(w.t().is_contiguous() for w in weights):  # column-major: stack the (in, out) matrices side by side
        stacked = torch.cat([w.t() for w in weights], dim=1).t()
    else:
        stacked = torch.cat(weights, dim=0)
    offset = 0
    for linear, w in zip(linears, weights):
        linear.weight = nn.Parameter(stacked[offset : offset + w.shape[0]], requires_grad=False)
        offset += w.shape[0]
    return stacked


def _stack_biases(linears: tuple[nn.Linear, ...]) -> torch.Tensor:
    """(sum of outs,) stacked bias; each linear's bias becomes a view of its part."""
    biases = [linear.bias.detach() for linear in linears if linear.bias is not None]
    stacked = torch.cat(biases)
    offset = 0
    for linear, b in zip(linears, biases):
        linear.bias = nn.Parameter(stacked[offset : offset + b.shape[0]], requires_grad=False)
        offset += b.shape[0]
    return stacked
