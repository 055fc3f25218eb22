"""oneDNN-prepacked bf16 weights for the target's linear products on a CPU.

`F.linear` with a bf16 weight hands oneDNN a plain row-major matrix, which its GEMM re-blocks into the
layout its AVX512-BF16 kernel reads on every call. `prepack_bf16` does that once at load time
(`torch.ops.mkldnn._reorder_linear_weight`), and `models.layers.linear` multiplies with the packed copy
(`torch.ops.mkldnn._linear_pointwise`). Same kernel, same accumulation: the outputs are F.linear's to
the bit (checked for every weight when it is packed, else that weight stays on F.linear), so a packed
row is still computed the same alone or among others (tests/test_fast_path.py), and every committed
bf16 output stays what it was. Measured here (docs/fast-path.md): SmolLM2's layer shapes 1.2-1.9x
faster per product, a whole bf16 decode and an 8-token verify about 0.7-0.78x the time.

Cost: the packed copy sits beside the plain weight (which state_dict, the drafters and the embedding
still read), so the bf16 target's linear weights take twice the memory (SmolLM2-135M: +0.27 GB).

Legend: N output features, K input features.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.models.layers import Linear, QKVProjection, SwiGLU

# Rows of the random inputs the packed product is checked on against F.linear: a padded decode (2), a
# verify (8) and a block that spans the GEMM's row tiles unevenly (19).
_CHECK_ROWS = (2, 8, 19)


def prepack_available() -> bool:
    """Whether this torch and this CPU have oneDNN's packed bf16 linear: x86 CPU builds of torch have the
    op, and oneDNN's bf16 path needs AVX512BW/VL/DQ or AVX-NE-CONVERT (on an AVX2-only CPU the reorder
    raises, and every weight stays on F.linear)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros((1, 1), dtype=torch.bfloat16), 2)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A (N, K) bf16 CPU weight prepacked for oneDNN, or None where packing is unavailable or the packed
    product would not give F.linear's bits on this machine."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or not prepack_available():
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2)
    generator = torch.Generator().manual_seed(0)
    for rows in _CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x, weight.detach())
        if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), expected):
            return None
    return packed


def prepack_bf16(model: nn.Module) -> None:
    """Give every bf16 product under `model` a prepacked weight: the stacked q/k/v and gate/up matrices
    (`fuse_projections`) and every other `Linear` (the named parts of a stacked matrix are not used and
    stay unpacked). Frozen inference modules on a CPU; elsewhere every weight stays on F.linear."""
    fused_parts: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QKVProjection) and module.qkv_weight is not None and module.qkv_scale is None:
                fused_parts.update(id(m) for m in (module.q_proj, module.k_proj, module.v_proj))
                module.qkv_packed = pack_weight(module.qkv_weight)
            elif isinstance(module, SwiGLU) and module.gate_up_weight is not None and module.gate_up_scale is None:
                fused_parts.update(id(m) for m in (module.gate_proj, module.up_proj))
                module.gate_up_packed = pack_weight(module.gate_up_weight)
        for module in model.modules():
            if isinstance(module, Linear) and id(module) not in fused_parts and module.weight_scale is None:
                if module.weight.requires_grad:
                    raise ValueError("prepack_bf16 is for frozen inference modules; call requires_grad_(False) first")
                module.weight_packed = pack_weight(module.weight)


def drop_packed(model: nn.Module) -> None:
    """Undo `prepack_bf16`: every product under `model` goes back to F.linear on the plain weights (the
    same bits; `hspec bench decode` times both)."""
    for module in model.modules():
        if isinstance(module, QKVProjection):
            module.qkv_packed = None
        elif isinstance(module, SwiGLU):
            module.gate_up_packed = None
        elif isinstance(module, Linear):
            module.weight_packed = None
