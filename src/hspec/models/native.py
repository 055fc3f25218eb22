"""The native decoder stack: the target's decoder layers in C++ for decodes and verifies.

A SmolLM2 token runs ~2,600 ATen operators (about 86 per layer), and on the CPU the Python interpreter
between them cost about as much as the small operators themselves. `decoder_stack.cpp` makes the same
operator calls with the same arguments in the same order, so its results have the Python layers' bits
(tests/test_native.py checks logits, hidden states and the pool's K/V for equality); it only takes the
interpreter out. It is built once per machine with torch's C++ extension loader (a compiler and ninja;
~20-60 s, cached under torch's extensions directory, TORCH_EXTENSIONS_DIR) the first time a
row-invariant target loads, one process at a time (`_build_lock`, which also clears what a killed build
left). If it cannot be built, a warning says why and the Python layers run: the same outputs, slower.
docs/fast-path.md ("The native decoder stack") has the measurements.

hspec's CPU kernels (`cpu_kernels.cpp`: int8, int4 and w4a8 products, the bf16 RMSNorm, attention, RoPE with
the KV writes) are a library of their own, loaded by `load_kernels` and called as torch.ops.hspec.* by the
Python layers and the stack alike (docs/fast-path.md, "hspec's CPU kernels").

Legend: T new tokens, S context length, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import filelock
import torch
import torch.nn.functional as F
from torch import nn

from hspec.models.config import TargetConfig
from hspec.models.formats.base import ROW_BLOCK
from hspec.models.layers import _FP32_VALUE_CHUNK, _KEY_MULTIPLE, _MIN_ATTENTION_ROWS, _VALUE_CHUNK

_SOURCE = Path(__file__).with_name("decoder_stack.cpp")
_KERNELS_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# How long a load waits for another process building the same extension (`_build_lock`): a build takes 20-60 s
# alone and a few minutes on a loaded machine; past this, the load runs without it, with a warning.
_BUILD_LOCK_TIMEOUT_S = 600.0


def build_extension() -> ModuleType | None:
    """Compile (or load the cached build of) `decoder_stack.cpp`; None, with a warning naming the cause,
    where that fails (no C++ compiler, no ninja, headers missing)."""
    return _build("hspec_decoder_stack", _SOURCE, ["-O2"], "the native decoder stack could not be built",
                  "the Python layers run instead, with the same outputs, slower")


def load_kernels() -> bool:
    """Whether hspec's CPU kernels (`cpu_kernels.cpp`, torch.ops.hspec.*) run here: compiled (or loaded from
    the cache) once per process, and this CPU has AVX2 and FMA. False, with a warning naming the cause,
    where the build fails. torch aborts the process on a second registration of the same operators (a
    build loaded from another extensions directory), so a process that has them does not load them again.
    -O3 unrolls the kernels' register tiles (at -O2 the int8 kernel of 8 rows took 2.5x as long);
    -fopenmp lets `at::parallel_for`, a header template, split the outputs among torch's threads."""
    if not hasattr(torch.ops.hspec, "available"):
        built = _build("hspec_cpu_kernels", _KERNELS_SOURCE, ["-O3", "-fopenmp"], "hspec's CPU kernels could not "
                       "be built", "torch's kernels run instead, slower", ["-fopenmp"], python_module=False)
        if not built:
            return False
        _register_product_shapes()
    return bool(torch.ops.hspec.available())


def kernels_loaded() -> bool:
    """Whether this process has loaded hspec's CPU kernels (`load_kernels`) and this CPU runs them; never
    builds. A drafter under a target that runs them multiplies its int8 weights with them too."""
    return hasattr(torch.ops.hspec, "available") and bool(torch.ops.hspec.available())


def integer_capability() -> str:
    """Which forms hspec's kernels take in this process: "avx512_vnni" (where the CPU has AVX512-VNNI: the
    w4a8 and w8a8 products in vpdpbusd tiles, the attention's value sums in 512-bit vectors), "avx2", or
    "none" where the kernels are not loaded. Both forms give the same bits; HSPEC_CPU_CAPABILITY=avx2 keeps
    the AVX2 ones (models/cpu_kernels.cpp, `avx512_kernels`)."""
    return str(torch.ops.hspec.integer_capability()) if kernels_loaded() else "none"


def _register_product_shapes() -> None:
    """Tell torch.compile what the int8 products a drafter runs return, (M, N) in x's dtype, so that a compiled
    drafter calls hspec's kernels rather than leaving the graph: `hspec::int8_linear` (x (M, K), weight
    (N, K)) and `hspec::w8a8_linear` (weight (N / 8, K / 32, 256), models.formats.w4a8.pack_w8a8); and its norms,
    `hspec::rms_norm` (x's shape)."""
    @torch.library.register_fake("hspec::int8_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("hspec::w8a8_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0] * 8)

    @torch.library.register_fake("hspec::rms_norm")  # a drafter's bf16 norms (`runtime.prepare_for_inference`)
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)


def _build(name: str, source: Path, cflags: list[str], failure: str, fallback: str,
           ldflags: list[str] | None = None, python_module: bool = True,
           lock_timeout_s: float = _BUILD_LOCK_TIMEOUT_S) -> ModuleType | bool | None:
    """torch's loader on one source: the Python module (`python_module`), else True once the library is
    loaded; None, with a warning, where that fails, or where another process has been building it for
    `lock_timeout_s` (`_build_lock`)."""
    from torch.utils import cpp_extension

    try:
        # torch's own choice of folder (TORCH_EXTENSIONS_DIR, else its cache), named here so that hspec's lock
        # and torch's baton guard the same one
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _ninja_on_path(), _build_lock(build_dir, lock_timeout_s):
            module = cpp_extension.load(name, [str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                                        build_directory=str(build_dir), is_python_module=python_module,
                                        verbose=False)
            return module if python_module else True
    except Exception as error:  # a missing compiler or ninja raises RuntimeError or OSError, a bad build others
        lines = str(error).strip().splitlines() or [repr(error)]
        cause = next((line.strip() for line in lines if ": error" in line), lines[-1])  # the compiler's first error
        warnings.warn(f"hspec: {failure} ({type(error).__name__}: {cause}); {fallback} (docs/fast-path.md)",
                      stacklevel=3)
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold hspec's lock on `build_dir` around a build, and remove torch's baton if a killed build left it.

    torch's loader guards a build folder with a baton file, `lock` (torch.utils.file_baton): made when a
    build starts, deleted when it ends. A build killed midway leaves it, and every later load, `hspec serve`
    included, then waits on it forever. hspec's lock beside it, `hspec-build.lock`, is a kernel lock
    (filelock) that dies with its holder: whoever holds it knows that no other hspec build is running in
    this folder, so a baton found then is stale. Waiting more than `timeout_s` for a live holder (a build
    hung, or a machine so loaded that it takes that long) raises TimeoutError naming the lock.
    """
    lock = filelock.FileLock(build_dir / "hspec-build.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"[hspec] waiting for another process building {build_dir.name} (lock {lock.lock_file})", flush=True)
        try:
            lock.acquire(timeout=timeout_s)
        except filelock.Timeout as err:
            raise TimeoutError(f"another process has held {lock.lock_file} for over {timeout_s:.0f} s while building "
                               f"in {build_dir}; let it finish, or stop it and load again") from err
    try:
        baton = build_dir / "lock"
        if baton.exists():
            baton.unlink(missing_ok=True)
            warnings.warn(f"hspec: removed {baton}, the build lock a build killed midway left behind (torch "
                          "would have waited on it forever); building again", stacklevel=4)
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's loader runs `ninja` from PATH; the `ninja` package puts it in the environment's bin folder,
    which is not on PATH when the environment is not activated (`.venv/bin/hspec ...`). Prepend it for
    the build only."""
    try:
        import ninja
    except ImportError:  # a system ninja may still be on PATH
        yield
        return
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + previous
    try:
        yield
    finally:
        os.environ["PATH"] = previous


class NativeDecoderStack:
    """`decoder_stack.cpp` bound to one target's decoder layers (`TargetModel.layers`, models/llama.py).

    Built after the target's weights reached their final storage (fused, quantized, prepacked:
    `loading.build_model`), it keeps references to those tensors; a layer whose weights are replaced
    afterwards would not be seen, so nothing replaces them.
    """

    def __init__(self, extension: ModuleType, config: TargetConfig, layers: nn.ModuleList) -> None:
        c = config
        self.extension = extension
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = (c.num_heads, c.num_kv_heads, c.head_dim,
                                                                       c.rms_norm_eps)
        # the layers' norms and attention run hspec's kernels (`build_model` sets them before building the stack)
        self.kernels = all(layer.input_layernorm.kernel and layer.post_attention_layernorm.kernel
                           and layer.self_attn.kernel for layer in layers)
        self.weights: list[torch.Tensor | None] = []  # 15 per layer, the order decoder_stack.cpp reads
        for layer in layers:
            qkv, o_proj, mlp = layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp
            self.weights += [layer.input_layernorm.weight, qkv.qkv_weight, qkv.qkv_bias, qkv.qkv_scale,
                             qkv.qkv_packed, o_proj.weight, o_proj.weight_scale, o_proj.weight_packed,
                             layer.post_attention_layernorm.weight, mlp.gate_up_weight, mlp.gate_up_scale,
                             mlp.gate_up_packed, mlp.down_proj.weight, mlp.down_proj.weight_scale,
                             mlp.down_proj.weight_packed]

    def __deepcopy__(self, memo: dict) -> NativeDecoderStack:
        """A deep copy of its model binds the copy's tensors (`memo`); the compiled extension is shared."""
        copied = copy.copy(self)
        copied.weights = copy.deepcopy(self.weights, memo)
        return copied

    @staticmethod
    def fits(layers: nn.ModuleList) -> bool:
        """Whether the stack can run these decoder layers at all: fused q/k/v and gate/up
        (`fuse_projections`), no per-head q/k norm (Qwen3), no bias on o_proj or the MLP."""
        return all(layer.self_attn.qkv.qkv_weight is not None and layer.mlp.gate_up_weight is not None
                   and layer.self_attn.qkv.q_norm is None and layer.self_attn.o_proj.bias is None
                   and layer.mlp.down_proj.bias is None for layer in layers)

    def covers(self, x: torch.Tensor, node_tables: bool) -> bool:
        """Whether a decode's or verify's forward of embeddings x (B, T, H) runs here (a prompt's prefill never
        does, `TargetModel.prefill`): not a tree whose nodes each read their own copy of their keys
        (`node_tables`: a table row per node, where the target does not share a tree's keys,
        `TargetModel.tree_shares_keys`), no autograd, on the CPU in a
        row-invariant dtype, and either attending with hspec's kernel, which computes each query row alone
        (any T, a tree under its mask included), or with each sequence's T * G query rows in one product
        (the Python layers keep every other case)."""
        rows = x.shape[1] * self.num_heads // self.num_kv_heads
        return (not node_tables and (self.kernels or rows <= ROW_BLOCK) and x.device.type == "cpu"
                and x.dtype != torch.float32 and not torch.is_grad_enabled())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_k: torch.Tensor,
                 pool_v: torch.Tensor, capacity: int, write_slots: torch.Tensor, slots: torch.Tensor,
                 contiguous_start: int | None, mask: torch.Tensor | None, hidden_layers: list[int]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layers over x (B, T, H) whose keys (the T new ones included) sit at `slots` (B, S) of the
        pool's (L_all, slots, Hkv, D) K and V, read as `PagedKVPool.gather` reads them: a view from
        `contiguous_start` (a lone sequence's consecutive slots), else a gather. Returns the last layer's
        output and the outputs of `hidden_layers` (1-based, ascending), each (B, T, H)."""
        s = slots.shape[1]
        width = s + -s % _KEY_MULTIPLE
        start = key_end = 0
        gathered = None
        if contiguous_start is None:
            gathered = F.pad(slots, (0, width - s)) if width > s else slots  # (B, W)
        else:
            start = contiguous_start
            key_end = start + width if start + width <= capacity else start + s
        out = self.extension.decoder_stack(x, cos, sin, self.weights, pool_k, pool_v, write_slots, gathered, start,
                                           key_end, s, width, mask, self.num_heads, self.num_kv_heads, self.head_dim,
                                           self.eps, ROW_BLOCK, _MIN_ATTENTION_ROWS, _VALUE_CHUNK, _FP32_VALUE_CHUNK,
                                           self.kernels, hidden_layers)
        return out[0], out[1:]
