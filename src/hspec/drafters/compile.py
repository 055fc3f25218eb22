"""A trained drafter's block forward compiled with torch.compile (docs/fast-path.md#compiled-drafter).

Only the drafter is compiled, never the target. Inductor fuses the block forward's ~400 small ops
(norms, the Mamba-2 scan, RoPE, attention over the target's K/V), which on a 2-core CPU cost more
than its matrix products. A compiled drafter may round differently from the eager one, so a draft
can change; the output cannot, because the target verifies every draft with its own forward.

`block_logits` is compiled with dynamic shapes (the context length changes every step), once per
process. Inductor keeps what it built in its on-disk cache, so a later process compiles from there
(measured here: about 4 min on 2 cores the first time, about 30 s from the cache). If compiling
fails (no C++ compiler, an unsupported op), the drafter warns once and stays eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from hspec.drafters.common import BlockContext, NeuralDrafter


class CompiledBlockForward:
    """Calls `drafter.block_logits` through torch.compile; falls back to the eager forward for good
    the first time the compiled call fails where the eager one succeeds (a compile failure)."""

    def __init__(self, drafter: NeuralDrafter) -> None:
        self.kind = drafter.kind
        self.eager: Callable[[BlockContext], torch.Tensor] = drafter.block_logits
        self.compiled: Callable[[BlockContext], torch.Tensor] | None = torch.compile(self.eager, dynamic=True)

    @property
    def is_compiled(self) -> bool:
        """False once compiling failed and the eager forward took over."""
        return self.compiled is not None

    def __call__(self, ctx: BlockContext) -> torch.Tensor:
        if self.compiled is None:
            return self.eager(ctx)
        try:
            return self.compiled(ctx)
        except Exception as compile_error:
            logits = self.eager(ctx)  # an error of the forward itself raises here, as without compiling
            self.compiled = None
            warnings.warn(f"torch.compile failed for drafter {self.kind!r}, which stays eager: "
                          f"{type(compile_error).__name__}: {compile_error}", RuntimeWarning, stacklevel=2)
            return logits


def compile_block_forward(drafter: NeuralDrafter) -> CompiledBlockForward:
    """Route `drafter`'s block forward through torch.compile (in place); returns the wrapper."""
    if isinstance(drafter.block_logits, CompiledBlockForward):
        return drafter.block_logits
    compiled = CompiledBlockForward(drafter)
    drafter.block_logits = compiled  # type: ignore[method-assign]  # the instance's, not the class's
    return compiled
