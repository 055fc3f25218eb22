"""What this machine's CPU offers: the feature flags its kernel reports. Read by the dtype choice
(`models.dtype`), which kernels run, and what every results file records (`provenance`)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist, e.g. macOS).
    Read once per file: the hardware does not change while a process runs, and `models.layers` asks on
    every prompt's products."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 says flags, ARM says Features
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it ("" where /proc/cpuinfo has none), e.g. for keying
    what was measured on this machine (`decoding.step_cost`)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""
