"""How many 512-bit `vpdpbusd` (and, for scale, FMAs) one core retires a nanosecond: the ceiling of the w4a8/w8a8
VNNI tiles' multiply-adds (docs/fast-path.md, "AVX512-VNNI tiles"; results/verify_breakdown/README.md reads a
verify's extra rows against it).

Compiles a probe with the system C compiler: 12 independent accumulators per instruction (so its latency does not
count), the instruction in inline assembly, timed by the thread's CPU clock, best of 5 runs.

    python scripts/vnni_throughput.py [--iterations 20000000] [--out results/verify_breakdown]

Writes <out>/vnni_throughput.{json,md}. Needs AVX512-VNNI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hspec.provenance import provenance, provenance_markdown, write_results

# One function per (instruction, vector width): 12 accumulators, each updated once an iteration.
_PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#define TWELVE(op, r) op(r "0") op(r "1") op(r "2") op(r "3") op(r "4") op(r "5") op(r "6") op(r "7") \
  op(r "8") op(r "9") op(r "10") op(r "11")
#define DPBUSD(acc) "vpdpbusd %%zmm30, %%zmm31, %%" acc "\n"
#define DPBUSD_Y(acc) "vpdpbusd %%ymm30, %%ymm31, %%" acc "\n"
#define FMA(acc) "vfmadd231ps %%zmm30, %%zmm31, %%" acc "\n"
#define PROBE(name, op, r)                                                                        \
  __attribute__((target("avx512f,avx512vl,avx512vnni"))) double name(long n) {                   \
    double t = now();                                                                             \
    for (long i = 0; i < n; ++i) __asm__ volatile(TWELVE(op, r) ::: "xmm0", "xmm1", "xmm2", "xmm3", \
        "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11");                       \
    return (now() - t) / (12.0 * n) * 1e9;                                                        \
  }
PROBE(zmm_dpbusd, DPBUSD, "zmm")
PROBE(ymm_dpbusd, DPBUSD_Y, "ymm")
PROBE(zmm_fma, FMA, "zmm")
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  double best[3] = {1e9, 1e9, 1e9};
  for (int r = 0; r < 5; ++r) {
    double t[3] = {zmm_dpbusd(n), ymm_dpbusd(n), zmm_fma(n)};
    for (int i = 0; i < 3; ++i) if (t[i] < best[i]) best[i] = t[i];
  }
  printf("vpdpbusd_zmm %.5f\nvpdpbusd_ymm %.5f\nvfmadd231ps_zmm %.5f\n", best[0], best[1], best[2]);
  return 0;
}
"""

# Multiply-adds one instruction does: 16 lanes x 4 byte products (zmm), 8 x 4 (ymm), 16 (an fp32 FMA).
_MACS = {"vpdpbusd_zmm": 64, "vpdpbusd_ymm": 32, "vfmadd231ps_zmm": 16}


def measure(iterations: int) -> dict[str, float]:
    """ns per instruction, by name."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) on PATH")
    with tempfile.TemporaryDirectory() as work:
        source, binary = Path(work) / "probe.c", Path(work) / "probe"
        source.write_text(_PROBE)
        subprocess.run([compiler, "-O2", str(source), "-o", str(binary)], check=True)
        out = subprocess.run([str(binary), str(iterations)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split() for line in out.strip().splitlines())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=20_000_000, help="loop iterations a timing (default 2e7)")
    p.add_argument("--out", type=Path, default=Path("results/verify_breakdown"))
    args = p.parse_args(argv)
    ns = measure(args.iterations)
    command = "python scripts/vnni_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"provenance": provenance(command.strip(), {"iterations": args.iterations}), "ns_per_instruction": ns,
               "g_multiply_adds_per_s": {name: _MACS[name] / t for name, t in ns.items()}}
    lines = ["# 512-bit vpdpbusd throughput on one core", "", provenance_markdown(payload["provenance"]), "",
             "12 independent accumulators, best of 5 timings (thread CPU time).", "",
             "| instruction | ns each | G per second | G multiply-adds per second |", "|---|---|---|---|"]
    for name, t in ns.items():
        lines.append(f"| {name} | {t:.4f} | {1 / t:.2f} | {_MACS[name] / t:.0f} |")
    write_results(args.out, "vnni_throughput", payload, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
