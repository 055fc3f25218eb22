"""Which floating dtype the target (and with it its KV pool and every drafter) runs in.

`--dtype auto` picks what measures fastest for the hardware (docs/fast-path.md has the numbers):

- a CUDA device: bfloat16 (tensor cores; the accuracy every serving engine ships with);
- a CPU with native bf16 dot products (AVX512-BF16 or AMX-BF16): bfloat16, because decoding is bound by
  reading the weights and bf16 halves the bytes while the instructions keep the math fast;
- any other CPU (AVX2 only, ARM without bf16 support here): float32, because there torch computes bf16
  products in software and a bf16 forward gains little over the exact fp32 one (an AVX2 EPYC: decode
  0.81x float32's time, an 8-token verify the same).

`--dtype int8` and `--dtype int4` are never picked by auto: they store the target's linear weights as
int8 (one scale per output row) or its decoder layers' as int4 (groups of 32, the LM head int8;
`models.formats`) and compute in bfloat16. They read a half or about a quarter of bf16's bytes per token
and decode fastest on a CPU, but change the model's numbers, so a user asks for them. `--dtype w4a8` stores
the weights as int4 does and also rounds each product's input rows to int8 blocks of 32 (llama.cpp's
Q4_1 x Q8_1 and Q8_0 x Q8_1 products): integer dot products, about twice as fast again for one row,
another model again (`models.formats`). It needs hspec's CPU kernels (x86-64 with AVX2 and FMA).

Greedy speculative decoding stays lossless in every dtype: the target verifies in the dtype it decodes in,
and the decoding loop compares the two within one runtime and dtype (see docs/fast-path.md for where
1-token and multi-token forwards can round differently).
"""

from __future__ import annotations

import torch

from hspec.machine import cpu_flags

DTYPE_CHOICES = ("auto", "fastest", "float32", "bfloat16", "int8", "int4", "w4a8")
# `--dtype fastest`: w4a8 where hspec's kernels run, else auto (`models.loading.fastest_dtype`).
FASTEST = "fastest"
# `--dtype` names that store the target's linear weights quantized (bfloat16 between the products).
QUANTIZED_DTYPES = ("int8", "int4", "w4a8")
# `--dtype` names that only hspec's CPU kernels compute (torch has no kernel for them).
KERNEL_ONLY_DTYPES = ("w4a8",)
_NAMED = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# /proc/cpuinfo flags of instructions that compute bf16 dot products natively.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when this CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu",
                  flags: frozenset[str] | None = None) -> torch.dtype:
    """`--dtype` (auto, float32, bfloat16; fp32/bf16 accepted) -> a torch dtype for `device`.

    `flags` overrides the CPU flags read from /proc/cpuinfo (for tests).
    """
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {name} is not a floating dtype the runtime runs in; use float32 or bfloat16")
        return name
    if quantized_weights(name):  # int8, int4 or w4a8 weights, bf16 between the products
        return torch.bfloat16
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16(flags) else torch.float32
    if name not in _NAMED:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPE_CHOICES)}")
    return _NAMED[name]


def slow_dtype_note(name: str | torch.dtype, device: torch.device | str = "cpu",
                    flags: frozenset[str] | None = None) -> str | None:
    """What to tell a user who asked for bfloat16 on a CPU without native bf16 dot products, else None.

    There torch emulates bf16 products in software: on an AVX2-only EPYC a bf16 decode of SmolLM2 took
    0.81x float32's time and an 8-token verify about the same, while int4 and int8 weights (bf16 rows
    into their own kernels) decoded in 0.39x and 0.46x (docs/fast-path.md#an-avx2-host).
    """
    if name not in (torch.bfloat16, "bfloat16", "bf16") or torch.device(device).type != "cpu":
        return None
    if cpu_has_native_bf16(flags):
        return None
    return ("--dtype bfloat16 on this CPU (no AVX512-BF16 or AMX-BF16) runs bf16 products in software: about "
            "as fast as float32, which --dtype auto picks here; --dtype int4 or int8 decode about twice as fast "
            "(docs/fast-path.md#an-avx2-host); the output stays lossless either way")


def quantized_weights(name: str | torch.dtype) -> bool:
    """True when `--dtype` asks for quantized linear weights: int8, int4 or w4a8 (`models.formats`)."""
    return name in QUANTIZED_DTYPES


DRAFTER_PRECISION_CHOICES = ("auto", "floating", "int8", "w4a8")


def drafter_int8(precision: str, target_dtype: str, device: torch.device | str = "cpu") -> bool:
    """Whether a drafter's linear weights are stored as int8 (`--drafter-precision`).

    A drafter's weights only decide what it drafts, never what the target outputs, so their storage is
    a speed choice. auto = int8 when the target runs in int8 or int4, or in bfloat16 on a CPU: drafting 7 rows
    is bound by reading ~50 MB of drafter weights, and int8 halves them (measured here: propose 7.3 ->
    6.4 ms, the same tau on Spec-Bench, docs/fast-path.md#int8-drafter); floating elsewhere (float32,
    the exact reference, and GPUs). floating keeps the target's floating dtype; int8 forces int8
    (computing in the target's floating dtype); w4a8 is int8 where hspec's w8a8 kernel would multiply the
    int8 weights, with the linears it takes stored as its w4a8 tiles instead (`runtime.prepare_for_inference`:
    int4 levels in groups of 32, ~5/8 of int8's bytes).
    """
    if precision not in DRAFTER_PRECISION_CHOICES:
        raise ValueError(f"unknown drafter precision {precision!r}; allowed: {', '.join(DRAFTER_PRECISION_CHOICES)}")
    if precision == "auto":
        return quantized_weights(target_dtype) or (target_dtype == "bfloat16" and torch.device(device).type == "cpu")
    return precision in ("int8", "w4a8")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the spelling `--dtype` takes and results files record)."""
    return str(dtype).removeprefix("torch.")
