"""Memory layout of linear weights for inference on CPU.

`nn.Linear` keeps its weight as a row-major (out, in) matrix. On CPU a forward over several rows at
once (an 8-token verify, a prefill, a drafter's block) runs markedly faster when the same (out, in)
weight is the transpose of a contiguous (in, out) matrix: the GEMM then reads it in the order it
consumes it. A one-row forward (plain decoding) costs the same either way. `hspec bench decode`
measures the verify-to-decode cost ratio this gives (results/decode_cpu.md).

The values never change, only their order in memory, so outputs are those of the row-major layout up
to the rounding of a different GEMM kernel.
"""

from __future__ import annotations

from torch import nn


def store_linear_weights_column_major(module: nn.Module) -> None:
    """Re-store every `nn.Linear` weight under `module` as the transpose of a contiguous (in, out) tensor.

    Weights already stored that way (or shared with a module converted earlier) are left alone, and a
    weight shared by several modules stays shared: each distinct tensor is converted once and every
    owner is pointed at the result. The `requires_grad` flags are kept.
    """
    converted: dict[int, nn.Parameter] = {}
    for child in module.modules():
        if not isinstance(child, nn.Linear):
            continue
        weight = child.weight
        if id(weight) not in converted:
            if not weight.is_contiguous():
                continue
            converted[id(weight)] = nn.Parameter(weight.detach().t().contiguous().t(),
                                                 requires_grad=weight.requires_grad)
        child.weight = converted[id(weight)]
