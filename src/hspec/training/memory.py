"""Whether freed memory stays in the process: glibc's malloc settings for a training process on a CPU.

By default glibc serves every allocation above a threshold (128 KiB, adapting up to 32 MiB) with a fresh
`mmap` and returns it to the kernel on free, and trims the heap's free top above 128 KiB. A training step
allocates and frees tensors of megabytes by the hundred (logits (N, K, Vp) in fp32 are 15 MB at 64 blocks,
the dense (V, r) gradient of the Markov head's embedding 50 MB), so every step touches fresh pages, and
each first touch is a page fault. In a virtual machine a fault costs microseconds: on this host a fresh
50 MB zero-fill took 68 ms against 18 ms for the same fill of reused memory (results/train_throughput/).
`retain_freed_memory` keeps freed memory in the heap for reuse instead (no `mmap` allocations, no trim):
the process's resident size then stays at its peak. It is a process-wide setting of the C library,
made by the command that trains (`hspec train`, `hspec bench train`), never on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc's malloc.h)
_NO_TRIM = 2**31 - 1  # the largest value mallopt takes: the heap's free top is never returned


@functools.cache
def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's mallopt, or None on another C library or system."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Keep freed memory in the process for reuse (module docstring); False where glibc is not there."""
    mallopt = _mallopt()
    return bool(mallopt and mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _NO_TRIM))

