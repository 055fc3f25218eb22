"""Memory layout of linear weights for inference on CPU.

`nn.Linear` keeps its weight as a row-major (out, in) matrix. On CPU a forward over several rows at
once (an 8-token verify, a prefill, a drafter's block) can run faster when the same (out, in) weight
is the transpose of a contiguous (in, out) matrix, the order in which the GEMM consumes it; a one-row
forward (plain decoding) costs the same either way. How much it gains depends on the host and the
thread count: `hspec bench decode` times both layouts interleaved (results/decode_cpu.md).

The values never change, only their order in memory, so outputs are those of the row-major layout up
to the rounding of a different GEMM kernel.
"""

from __future__ import annotations

from torch import nn


def store_linear_weights_column_major(module: nn.Module) -> None:
    """Re-store every `nn.Linear` weight under `module` as the transpose of a contiguous (in, out) tensor.

    Weights already stored that way are left alone. A tensor shared with other modules stays shared:
    each distinct tensor is converted once, and every module whose `weight` was that tensor (another
    linear, or an embedding tied to an LM head) is pointed at the result. `requires_grad` is kept.
    """
    converted: dict[int, nn.Parameter] = {}
    for child in module.modules():
        weight = child.weight if isinstance(child, nn.Linear) else None
        if weight is not None and weight.is_contiguous() and id(weight) not in converted:
            converted[id(weight)] = nn.Parameter(weight.detach().t().contiguous().t(),
                                                 requires_grad=weight.requires_grad)
    for child in module.modules():
        weight = getattr(child, "weight", None)
        if isinstance(weight, nn.Parameter) and id(weight) in converted:
            child.weight = converted[id(weight)]
