"""Floating weights (float32, bfloat16), and bf16 weights with a oneDNN-prepacked copy (`--dtype float32`,
`bfloat16`, `auto`; and every weight a quantized dtype leaves floating).

float32 and GPU rows take `F.linear` as it is. bf16 CPU rows keep a row's bits by two rules (see
`formats.base`): at most `ROW_BLOCK` rows per product, and at least 2: oneDNN's one-row kernel accumulates
in another order than its kernel for 2 to 32 rows, so a single row is computed as the first of two (a
two-row bf16 product costs what a one-row one does: it is bound by reading the weight).

The prepacked copy. `F.linear` with a bf16 weight hands oneDNN a plain row-major matrix, which its GEMM
re-blocks into the layout its AVX512-BF16 kernel reads on every call. `pack_weight` does that once at load
(`torch.ops.mkldnn._reorder_linear_weight`) and `FLOATING_PACKED` multiplies with it
(`torch.ops.mkldnn._linear_pointwise`): same kernel, same accumulation, F.linear's bits to the bit (checked
for every weight when it is packed, else that weight stays on F.linear). Measured here (docs/fast-path.md):
SmolLM2's layer shapes 1.2-1.9x faster per product, a whole bf16 decode 0.7-0.78x the time. The packed copy
sits beside the plain weight (which state_dict, the drafters and the embedding still read): a bf16
target's linear weights take twice the memory (SmolLM2-135M: +0.27 GB).

Legend: M rows, N output features, K input features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspec.models.formats.base import StoredWeight, WeightFormat, emulated_bf16, row_invariant

# Rows of the random inputs the packed product is checked on against F.linear: a padded decode (2), a
# verify (8) and a block that spans the GEMM's row tiles unevenly (19).
_CHECK_ROWS = (2, 8, 19)


class Floating(WeightFormat):
    """weight (N, K) floating, bias (N,) or None, no scale; packed (`FLOATING_PACKED`): oneDNN's copy."""

    name = "floating"

    def __init__(self, packed: bool) -> None:
        self.packed = packed  # multiplies with `weight_packed`, oneDNN's prepacked copy (`pack_weight`)

    def product(self, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
        padded = flat.shape[0] == 1 and row_invariant(flat)  # one row as the first of two (module doc)
        if padded:
            flat = flat.expand(2, -1)
        # a torch.compile graph cannot take oneDNN's opaque tensors (inductor picks its own kernel)
        if self.packed and not torch.compiler.is_compiling():
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        else:
            out = F.linear(flat, weight, bias)
        return out[:1] if padded else out

    def prefill(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None, packed: torch.Tensor | None, native_bf16: bool | None = None
                ) -> torch.Tensor:
        """All of a prompt's rows in one product (in fp32 where torch would emulate bf16, `WeightFormat.prefill`)."""
        if emulated_bf16(x, native_bf16):
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        rows = x.numel() // x.shape[-1]
        out = self.product(x.reshape(rows, x.shape[-1]), weight, bias, scale, packed)  # (M, N)
        return out.reshape(*x.shape[:-1], weight.shape[0])


FLOATING = Floating(packed=False)
FLOATING_PACKED = Floating(packed=True)


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
        expected = F.linear(x, weight.detach())
        if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), expected):
            return None
    return packed


def store_floating(weight: torch.Tensor) -> StoredWeight:
    """A floating weight with oneDNN's copy where `pack_weight` makes one, else as it is."""
    packed = pack_weight(weight)
    return StoredWeight(FLOATING if packed is None else FLOATING_PACKED, weight, None, packed)
