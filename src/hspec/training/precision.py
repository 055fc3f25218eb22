"""The arithmetic precision of drafter training: fp32, or bf16 autocast over fp32 master weights.

- `fp32`: every op in float32 (the reference).
- `bf16-autocast`: the drafter's forward and backward run under `torch.autocast(dtype=torch.bfloat16)`, so
  its matrix products read and multiply bf16 copies of the weights; the weights themselves, their gradients
  and AdamW's moments stay float32 (the master copy an update is applied to), the loss is computed from
  logits cast up to float32 (losses.py), and the target's distribution, the teacher, is computed in the
  target's own dtype outside autocast (features.py). No loss scaling: bf16 has float32's exponent range.
- `auto` (the CLI default): fp32 on a CPU without native bf16 dot products, where torch emulates bf16
  matrix products in software (results/train_precision_cpu.md, an AVX2-only Zen 3: a bf16-autocast step
  of hspec, Vp 8192, runs at 0.09x the steps/s of fp32, nearly all of it in `aten::mm`); bf16 autocast
  on a CUDA device (tensor cores) and on a CPU with AVX512-BF16 or AMX-BF16, where bf16 matrix products
  run natively (not yet measured for training on such a CPU: rerun scripts/bench_train_precision.py there).

A run records the precision it resolved to in its settings, so a resume cannot switch it silently.
"""

from __future__ import annotations

import contextlib

import torch

from hspec.models.dtype import cpu_has_native_bf16

PRECISIONS = ("fp32", "bf16-autocast")  # what a run records
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what `--precision` takes


def resolve_precision(name: str, device: torch.device | str = "cpu", flags: frozenset[str] | None = None) -> str:
    """`--precision` (auto, fp32, bf16-autocast) -> the precision a run on `device` trains in.

    `flags` overrides the CPU flags read from /proc/cpuinfo (for tests).
    """
    if name not in PRECISION_CHOICES:
        raise ValueError(f"unknown precision {name!r}; allowed: {', '.join(PRECISION_CHOICES)}")
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        return "bf16-autocast"
    return "bf16-autocast" if cpu_has_native_bf16(flags) else "fp32"


def precision_context(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context the drafter's forward runs in for `precision` (a no-op for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} here (resolve 'auto' first), "
                         f"got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def full_precision(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Turns off any surrounding autocast on `device`: what runs inside computes in its tensors' own dtype."""
    return torch.autocast(torch.device(device).type, enabled=False)
