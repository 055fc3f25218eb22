"""What bounds hspec's CPU kernels on this machine: vector instruction throughput and memory streaming.

Builds `scripts/vector_throughput.cpp` with the system C++ compiler (AVX2 and FMA needed) and runs it:
ns per 256-bit instruction for the instructions hspec's integer and float kernels lean on (8 independent
chains on one core, so latency does not count; the best of 3 timings), and GB/s of 1..T threads
streaming a 256 MiB buffer.
docs/fast-path.md (w4a8) reads a decode's weight streaming and a verify's instruction count against these.

    .venv/bin/python scripts/vector_throughput.py [--threads 2] [--rounds 50000000] [--out results/cpu_kernels_avx2]

Writes <out>/vector_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hspec.provenance import provenance, provenance_markdown, write_results

SOURCE = Path(__file__).with_name("vector_throughput.cpp")


def measure(threads: int, rounds: int) -> dict[str, float]:
    """Build the probe in a temporary folder, run it, and parse its "name value" lines."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        sys.exit("vector_throughput: no C++ compiler (c++ or g++) on PATH")
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "vector_throughput"
        subprocess.run([compiler, "-O2", "-mavx2", "-mfma", "-std=c++17", "-pthread", str(SOURCE), "-o", str(binary)],
                       check=True)
        lines = subprocess.run([str(binary), str(threads), str(rounds)], check=True, capture_output=True,
                               text=True).stdout.splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines if not line.startswith("#"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="stream with 1..THREADS threads (default 2)")
    parser.add_argument("--rounds", type=int, default=50_000_000,
                        help="rounds of 8 instructions per timing (default 50,000,000: ~0.1 s each)")
    parser.add_argument("--out", default="results/cpu_kernels_avx2", help="folder for vector_throughput.{json,md}")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        parser.error(f"--threads and --rounds must be >= 1, got {args.threads} and {args.rounds}")
    results = measure(args.threads, args.rounds)
    command = (f"python scripts/vector_throughput.py --threads {args.threads} --rounds {args.rounds} "
               f"--out {args.out}")
    meta = provenance(command, {"threads": args.threads, "rounds": args.rounds})
    rows = [f"| {name.removesuffix('_ns')} | {value:.3f} | {1 / value:.1f} |"
            for name, value in results.items() if name.endswith("_ns")]
    streams = [f"| {name.removeprefix('stream_gb_s_')} | {value:.1f} |"
               for name, value in results.items() if name.startswith("stream_gb_s_")]
    markdown = (f"# Vector instruction throughput and memory streaming\n\n{provenance_markdown(meta)}\n"
                "One core, 8 independent chains of each 256-bit instruction (its throughput, not its latency):\n\n"
                "| instruction | ns each | G per second |\n|---|---|---|\n" + "\n".join(rows) +
                "\n\nA 256 MiB buffer summed with 256-bit loads, best of 5:\n\n| threads | GB/s |\n|---|---|\n" +
                "\n".join(streams) + "\n")
    paths = write_results(Path(args.out), "vector_throughput", {"provenance": meta, "results": results}, markdown)
    print(markdown)
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
