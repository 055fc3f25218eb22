"""A trained drafter's tensor-only forwards compiled with torch.compile (docs/fast-path.md#compiled-drafter).

Only the drafter is compiled, never the target, and only its two tensor-only methods:
* `block_logits`, the block forward: inductor fuses its ~400 small ops (norms, the Mamba-2 scan,
  RoPE, attention over the target's K/V), which on a 2-core CPU cost more than its matrix products;
* `draft_greedy`, the block forward followed by the K-slot greedy Markov loop (`greedy_block`), what
  an all-greedy proposal runs: one compiled call, so dynamo checks its guards once a step (~0.6 ms a
  call here) and the loop's K small vector-matrix products with their max and softmax fuse as well.

For one sequence on a CPU both run compiled ahead of time instead (drafters/ahead_of_time.py): no guards and no
Python between the kernels. A compiled drafter may round differently from the eager one, so a draft can change;
the output cannot, because the target verifies every draft with its own forward.

Both are compiled with dynamic shapes (the context length changes every step), once per process.
Inductor keeps what it built in its on-disk cache, so a later process compiles from there (measured
here: about 4 min on 2 cores the first time, about 30 s from the cache). If compiling fails (no C++
compiler, an unsupported op), the method warns once and stays eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.fx.experimental._config as fx_config

from hspec.drafters.ahead_of_time import AheadOfTimeForward
from hspec.drafters.common import BlockContext, NeuralDrafter

COMPILED_METHODS = ("block_logits", "draft_greedy")


def no_duck_shapes() -> AbstractContextManager[None]:
    """Tracing in which sizes that happen to be equal stay separate symbols. By default dynamo gives dims
    of equal value one symbol and guards on their equality: a context of 64 keys became the head dim's
    64, and of as many keys as the pool had slots its stride's factor, and the next context length
    recompiled the drafter (~40 s here) in the middle of a decode."""
    return fx_config.patch(use_duck_shape=False)


class CompiledForward:
    """Calls one of `drafter`'s methods compiled: for one sequence on a CPU through an AOTInductor library
    (`AheadOfTimeForward`), else through torch.compile. Where the ahead-of-time path fails (no C++ compiler, an op
    export cannot trace) it warns once and every later call takes torch.compile's path; where that fails where
    the eager method succeeds (a compile failure), it warns once and the eager method takes over for good."""

    def __init__(self, drafter: NeuralDrafter, name: str, ahead_of_time: bool = True) -> None:
        self.kind, self.name = drafter.kind, name
        self.eager: Callable[..., object] = getattr(drafter, name)
        self.compiled: Callable[..., object] | None = torch.compile(self.eager, dynamic=True)
        # None: every call takes torch.compile's path (asked for, or the ahead-of-time path failed)
        self.ahead_of_time: AheadOfTimeForward | None = AheadOfTimeForward(drafter, name) if ahead_of_time else None

    @property
    def is_compiled(self) -> bool:
        """False once compiling failed and the eager method took over."""
        return self.compiled is not None

    def __call__(self, *args: object) -> object:
        ctx = args[0]
        if self.ahead_of_time is not None and isinstance(ctx, BlockContext) and self.ahead_of_time.covers(ctx):
            try:
                return self.ahead_of_time(ctx, *args[1:])  # type: ignore[arg-type]
            except Exception as aot_error:
                self.ahead_of_time = None
                warnings.warn(f"the ahead-of-time compile failed for drafter {self.kind!r} ({self.name}), which "
                              f"runs through torch.compile: {type(aot_error).__name__}: {aot_error}",
                              RuntimeWarning, stacklevel=2)
        if self.compiled is None:
            return self.eager(*args)
        try:
            with no_duck_shapes():
                return self.compiled(*args)
        except Exception as compile_error:
            result = self.eager(*args)  # an error of the method itself raises here, as without compiling
            self.compiled = None
            warnings.warn(f"torch.compile failed for drafter {self.kind!r} ({self.name}), which stays eager: "
                          f"{type(compile_error).__name__}: {compile_error}", RuntimeWarning, stacklevel=2)
            return result


def compile_drafter(drafter: NeuralDrafter, ahead_of_time: bool = True) -> dict[str, CompiledForward]:
    """Route `drafter`'s `COMPILED_METHODS` through torch.compile, or for one CPU sequence an AOTInductor library
    unless `ahead_of_time` is False (in place, once); returns the wrappers."""
    wrappers = {}
    for name in COMPILED_METHODS:
        method = getattr(drafter, name)
        if not isinstance(method, CompiledForward):
            method = CompiledForward(drafter, name, ahead_of_time)
            setattr(drafter, name, method)  # the instance's attribute, not the class's
        wrappers[name] = method
    return wrappers
