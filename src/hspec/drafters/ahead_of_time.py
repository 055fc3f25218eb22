"""A compiled drafter's forwards for one sequence on a CPU, compiled ahead of time by AOTInductor
(docs/fast-path.md#ahead-of-time-drafter).

torch.compile (`drafters/compile.py`) leaves two costs around its kernels on every call: dynamo checks its
guards (~0.5 ms a call here, one check per weight tensor among them), and inductor's Python wrapper allocates
buffers and calls ~150 kernels and extern products one interpreted line at a time. For the proposal of a
single sequence with every row greedy, what `hspec generate` and `hspec eval` run, both go: the drafter's
`draft_greedy` is exported once (`torch.export`, the context length a dynamic dimension) and compiled by
AOTInductor into a shared library whose C++ wrapper calls the kernels, with the weights inside it as
constants. A sampled row's block forward (`block_logits`) takes the same path, with a library of its own.
Drafts may round differently from the eager drafter's, as a torch.compile'd one's do; the output cannot change,
because the target verifies every draft.

The library reads its inputs in the layouts it was compiled for and does not check strides, so every call
hands it the same layouts: each context K/V either keys-innermost (as the KV pool stores K) or rows of Hkv x D
(as the pool stores V, whose window of one sequence already is contiguous), the choice made from the first
call's tensors. A keys-innermost K goes as (1, Hkv, D, W) with the context its first S keys: the pool layer's K
itself from the window's first key on where it fits in the storage (no copy), else a copy of the window (W = S;
1.5 MB a layer at 2,048 keys).

Compiling takes ~30-40 s on 2 cores. The library is kept in the hspec cache (`$HSPEC_CACHE/aot_drafters`, by
default ~/.cache/hspec/aot_drafters, ~110 MB for SmolLM2's H-Spec drafter, whose constants include the
target's embedding it reads), named by a digest of the exported graph, its weights and torch's version, so a
later process with the same drafter, code and draft length loads it instead of compiling (~3 s for the export
that names it, the digest and the load); the 8 most recently used libraries are kept, older ones deleted
(`prune_cache`).

Legend: K block, S context keys, W keys a stored K holds (W >= S), Hkv KV heads, D head dim, n_sel selected
target layers, H hidden, Vp draft vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hspec.drafters.common import CONTEXT_MULTIPLE, BlockContext, NeuralDrafter
from hspec.models.loading import cache_root

__all__ = ["KEEP_LIBRARIES", "AheadOfTimeForward", "aot_cache_dir", "prune_cache"]

# The context length of the example the graph is exported with: a multiple of CONTEXT_MULTIPLE that equals no
# other size of the drafters (export would otherwise take the two for one dimension and refuse the range).
_EXAMPLE_KEYS = 5 * CONTEXT_MULTIPLE
_MAX_KEYS = 1 << 20
_PARTIAL = "partial-"  # the name a library has while it compiles
_STALE_PARTIAL_S = 3600  # a partial file untouched this long belongs to a compile that was killed
KEEP_LIBRARIES = 8  # libraries kept in the cache, the most recently used ones (`prune_cache`)


def aot_cache_dir() -> Path:
    """Where compiled proposals are kept: $HSPEC_CACHE/aot_drafters (by default ~/.cache/hspec/aot_drafters)."""
    return cache_root() / "aot_drafters"


@dataclass(frozen=True)
class _Signature:
    """What one compiled library was built for: the block length K, per context K/V tensor its dtype and
    whether it is passed keys-innermost, and the dtype of the kept hidden states."""

    K: int
    context: tuple[tuple[torch.dtype, bool], ...]
    hidden_dtype: torch.dtype


class _FlatForward(nn.Module):
    """One of a drafter's `METHODS` over flat tensors: the function that is exported."""

    def __init__(self, drafter: NeuralDrafter, method: str, signature: _Signature) -> None:
        super().__init__()
        self.drafter = drafter
        self.method = method
        self.keys_last = [keys_last for _, keys_last in signature.context]

    def forward(self, block_tokens: torch.Tensor, positions: torch.Tensor, last_hidden: torch.Tensor,
                context_mask: torch.Tensor, anchor_tokens: torch.Tensor, *context: torch.Tensor
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """block_tokens, positions (1, K) long; last_hidden (1, n_sel, H); context_mask (1, S) bool; anchor_tokens
        (1,) long (read by `draft_greedy` only); then each context K and V: (1, Hkv, D, W) keys-innermost, of which
        the first S keys are the context (W >= S: `_keys_innermost`), or (1, S, Hkv, D). Returns what the method
        returns: the drafts (1, K) and their confidence (1, K), or the block's logits (1, K, Vp)."""
        keys = context_mask.shape[1]
        views = []
        for t, last in zip(context, self.keys_last):
            if last:
                torch._check(keys <= t.shape[3])
                t = t[..., :keys].permute(0, 3, 1, 2)
            views.append(t)  # (1, S, Hkv, D)
        ctx = BlockContext(block_tokens, positions, last_hidden, list(zip(views[0::2], views[1::2])), context_mask)
        if self.method == "draft_greedy":
            return type(self.drafter).draft_greedy(self.drafter, ctx, anchor_tokens)
        return type(self.drafter).block_logits(self.drafter, ctx)


class AheadOfTimeForward:
    """`drafter.<method>` (one of `METHODS`) for one CPU sequence through AOTInductor libraries, one per
    `_Signature`. `covers(ctx)` says whether a call can go here; the first call of a signature exports and
    compiles it (or loads it from `cache_dir`). Errors propagate: the caller (`drafters.compile.CompiledForward`)
    falls back to torch.compile.
    """

    METHODS = ("block_logits", "draft_greedy")

    def __init__(self, drafter: NeuralDrafter, method: str, cache_dir: Path | None = None) -> None:
        if method not in self.METHODS:
            raise ValueError(f"no ahead-of-time path for {method!r}; allowed: {', '.join(self.METHODS)}")
        self.drafter = drafter
        self.method = method
        self.cache_dir = cache_dir
        self.runners: dict[_Signature, object] = {}

    @staticmethod
    def covers(ctx: BlockContext) -> bool:
        """One sequence, on the CPU, not under autograd, no token history (DeLS-Spec's, which proposes on its own)."""
        return ctx.block_tokens.shape[0] == 1 and ctx.block_tokens.device.type == "cpu" \
            and not torch.is_grad_enabled() and ctx.history is None

    def __call__(self, ctx: BlockContext, anchor_tokens: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What the method returns for `ctx`: `draft_greedy` (which takes `anchor_tokens`) the drafts (1, K) as
        draft-vocabulary indices and their confidence (1, K), `block_logits` the logits (1, K, Vp)."""
        anchor = ctx.block_tokens[:, 0] if anchor_tokens is None else anchor_tokens
        signature = self.signature_of(ctx)
        runner = self.runners.get(signature)
        if runner is None:
            runner = self.runners[signature] = self._build(signature, ctx, anchor)
        out = runner(*self._inputs(ctx, anchor, signature))  # type: ignore[operator]
        return tuple(out) if self.method == "draft_greedy" else out

    @staticmethod
    def signature_of(ctx: BlockContext) -> _Signature:
        """The layouts this call's tensors are passed in: keys-innermost where the key index has stride 1."""
        context = tuple((t.dtype, t.shape[1] > 1 and t.stride(1) == 1) for pair in ctx.context_kv for t in pair)
        return _Signature(ctx.K, context, ctx.last_hidden.dtype)

    @staticmethod
    def _inputs(ctx: BlockContext, anchor_tokens: torch.Tensor, signature: _Signature) -> list[torch.Tensor]:
        """The flat inputs of `_FlatForward.forward`, each contiguous in its signature's layout."""
        inputs = [ctx.block_tokens.contiguous(), ctx.positions.contiguous(), ctx.last_hidden.contiguous(),
                  ctx.context_mask.contiguous(), anchor_tokens.contiguous()]
        tensors = [t for pair in ctx.context_kv for t in pair]
        inputs += [_keys_innermost(t) if last else t.contiguous() for t, (_, last) in zip(tensors, signature.context)]
        return inputs

    def _build(self, signature: _Signature, ctx: BlockContext, anchor_tokens: torch.Tensor) -> object:
        """Export `_FlatForward` with the context length dynamic, then load its library from the cache or
        compile it there."""
        with torch.inference_mode(False), torch.no_grad():
            example = _example(ctx, anchor_tokens, signature)
            keys = torch.export.Dim("context_keys", min=2, max=_MAX_KEYS)
            context = tuple({3: torch.export.Dim(f"stored_keys_{i}", min=2, max=_MAX_KEYS)} if last else {1: keys}
                            for i, (_, last) in enumerate(signature.context))
            dynamic = (None, None, None, {1: keys}, None) + ((context,) if context else ())  # *context: one tuple
            program = torch.export.export(_FlatForward(self.drafter, self.method, signature).eval(), tuple(example),
                                          dynamic_shapes=dynamic, strict=False)
        directory = self.cache_dir or aot_cache_dir()
        path = directory / f"{self.drafter.kind}-{self.method}-K{signature.K}-{_digest(program)}.pt2"
        if path.exists():
            os.utime(path)  # recently used: pruning goes by modification time
        else:
            directory.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(prefix=_PARTIAL, suffix=".pt2", dir=directory)
            os.close(handle)
            print(f"[hspec] compiling the {self.drafter.kind} drafter's {self.method} (K = {signature.K}) ahead of "
                  f"time, once (~30-40 s on 2 cores); kept in {directory}", file=sys.stderr, flush=True)
            try:
                with _quiet_pytree():
                    torch._inductor.aoti_compile_and_package(program, package_path=partial)
                os.chmod(partial, 0o644)
                os.replace(partial, path)  # whole or absent: a killed compile leaves no half library behind
            finally:
                if os.path.exists(partial):
                    os.remove(partial)
            prune_cache(directory)
        with _quiet_pytree():
            return torch._inductor.aoti_load_package(str(path))


@contextlib.contextmanager
def _quiet_pytree() -> Iterator[None]:
    """Without the FutureWarning torch's own packaging code raises against its pytree module (`LeafSpec`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        yield


def prune_cache(directory: Path, keep: int = KEEP_LIBRARIES) -> list[Path]:
    """Delete all but the `keep` most recently used libraries in `directory` (each ~110 MB for SmolLM2's H-Spec
    drafter; every change of code, weights or K makes a new one), and the partial files of compiles that stopped
    (a killed process cannot remove its own: none is written to for `_STALE_PARTIAL_S`); returns the deleted
    paths. Compiles in progress are left alone, and a process that has a deleted library loaded keeps it."""
    files = list(directory.glob("*.pt2"))
    libraries = sorted((p for p in files if not p.name.startswith(_PARTIAL)), key=lambda p: p.stat().st_mtime,
                       reverse=True)
    stale = [p for p in files if p.name.startswith(_PARTIAL) and time.time() - p.stat().st_mtime > _STALE_PARTIAL_S]
    deleted = []
    for old in libraries[keep:] + stale:
        try:
            old.unlink()
            deleted.append(old)
        except FileNotFoundError:  # another process pruned it first
            pass
    return deleted


def _example(ctx: BlockContext, anchor_tokens: torch.Tensor, signature: _Signature) -> list[torch.Tensor]:
    """Inputs of the call's shapes but `_EXAMPLE_KEYS` context keys (all visible), outside inference mode."""
    inputs = [ctx.block_tokens.clone(), ctx.positions.clone(), ctx.last_hidden.clone(),
              torch.ones(1, _EXAMPLE_KEYS, dtype=torch.bool), anchor_tokens.clone()]
    tensors = [t for pair in ctx.context_kv for t in pair]
    for i, (t, (dtype, last)) in enumerate(zip(tensors, signature.context)):
        _, _, hkv, d = t.shape
        # Stored keys W > S, a size of its own per tensor (equal sizes would be taken for one dimension).
        shape = (1, hkv, d, _EXAMPLE_KEYS + 1 + 2 * i) if last else (1, _EXAMPLE_KEYS, hkv, d)
        inputs.append(torch.randn(shape).to(dtype))
    return inputs


def _keys_innermost(t: torch.Tensor) -> torch.Tensor:
    """A context K (1, S, Hkv, D) whose keys are innermost (t.stride(1) == 1) as a contiguous (1, Hkv, D, W) tensor
    whose first S keys are t's. Where t is a window of a store laid out (Hkv, D, W) (the KV pool's K of one
    layer, W its slots), that is the store itself from t's first key on, without a copy: its rows run on past
    the window into keys the library never reads. Elsewhere, or where those rows would run past the end of the
    storage, a contiguous copy of t's keys (W = S)."""
    _, keys, hkv, d = t.shape
    stored = t.stride(3)
    fits = t.stride(1) == 1 and t.stride(2) == d * stored and keys <= stored
    if fits and t.storage_offset() + hkv * d * stored <= t.untyped_storage().nbytes() // t.element_size():
        return t.as_strided((1, hkv, d, stored), (hkv * d * stored, d * stored, stored, 1))
    return t.permute(0, 2, 3, 1).contiguous()


def _digest(program: torch.export.ExportedProgram) -> str:
    """A digest of what a compiled library depends on: torch's version, the graph and every weight's bytes."""
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(program.graph_module.code.encode())
    weights = {**program.state_dict, **program.constants}
    for name in sorted(weights):
        tensor = weights[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]
