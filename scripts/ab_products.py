"""The w4a8 and w8a8 products of this tree's CPU kernels against another commit's, interleaved in one process.

A change to the product tiles must keep every output's bits (docs/fast-path.md, "Row invariance by
construction") and is worth landing only if it is faster; timings from two processes on a shared CPU say
little, so this builds the other commit's models/cpu_kernels.cpp as a second library whose operators live
under another namespace (`hspec_baseline::`), then per shape and row count times both kernels call by call in
alternation (each call's thread CPU time, medians), and checks their outputs equal bit for bit. Each side's
weights are laid out by its own commit's pack_w4a8 and pack_w8a8.

Shapes: SmolLM2-135M's (the target's layers and LM head, w4a8 and w8a8) and H-Spec's drafter's (its
layers, pruned head of 8,192 rows and Markov W2 of rank 256); by default rows 1 (a decode, the Markov head's
slot), 7 (a drafted block) and 8 (a K = 7 verify).

    .venv/bin/python scripts/ab_products.py --baseline 66df221 [--rounds 60] [--rows 1,7,8]
        [--out results/native_drafter]

With --cold every call reads weights from memory, as a decode's products do (the target's weights far exceed
the caches and each is read once a step): each kernel walks its own copies of the weights, over 256 MiB in
all, so a copy was last read ~128 MiB of weights earlier; without it the weights stay hot in the caches after
the first round, as the Markov head's W2 does across its slots.

Writes <out>/ab_products.{json,md}. One thread (OMP_NUM_THREADS=1 is set before torch loads).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hspec.models.formats.int4 import quantize_groups  # noqa: E402
from hspec.models.formats.int8 import quantize_rows  # noqa: E402
from hspec.models.formats.w4a8 import pack_w4a8, pack_w8a8  # noqa: E402
from hspec.models.native import integer_capability, load_kernels  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402

# (name, N outputs, K inputs)
SHAPES = [("gate/up (1536 x 576)", 1536, 576), ("down (576 x 1536)", 576, 1536), ("q/o (576 x 576)", 576, 576),
          ("k/v (192 x 576)", 192, 576), ("LM head (49152 x 576)", 49152, 576),
          ("pruned head (8192 x 576)", 8192, 576), ("Markov W2 (8192 x 256)", 8192, 256)]
SOURCE = "src/hspec/models/cpu_kernels.cpp"
PACKING = "src/hspec/models/formats/w4a8.py"  # pack_w4a8 and pack_w8a8: the layout each side's kernels read
COLD_BYTES = 256 * 2**20  # the copies of each weight --cold walks through: several times any L3 of these hosts


def load_beside_baseline(commit: str) -> None:
    """This tree's kernels (torch.ops.hspec) and `commit`'s (torch.ops.hspec_baseline) loaded, one torch thread."""
    if not load_kernels():
        raise SystemExit("hspec's CPU kernels do not run here")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        build_baseline(commit, Path(workdir))


def build_baseline(commit: str, workdir: Path) -> None:
    """`commit`'s cpu_kernels.cpp with its operators renamed to hspec_baseline::, built and loaded."""
    from torch.utils import cpp_extension

    text = subprocess.run(["git", "show", f"{commit}:{SOURCE}"], check=True, capture_output=True, text=True).stdout
    text = text.replace("TORCH_LIBRARY(hspec,", "TORCH_LIBRARY(hspec_baseline,")
    text = text.replace("TORCH_LIBRARY_IMPL(hspec,", "TORCH_LIBRARY_IMPL(hspec_baseline,")
    source = workdir / "cpu_kernels_baseline.cpp"
    source.write_text(text)
    cpp_extension.load("hspec_cpu_kernels_baseline", [str(source)], extra_cflags=["-O3", "-fopenmp"],
                       build_directory=str(workdir), is_python_module=False, verbose=False)


def baseline_packing(commit: str) -> ModuleType:
    """`commit`'s models/formats/w4a8.py as a module: its pack_w4a8 and pack_w8a8 lay the weights out as its
    kernels read them (imports from the rest of hspec resolve to this tree)."""
    text = subprocess.run(["git", "show", f"{commit}:{PACKING}"], check=True, capture_output=True, text=True).stdout
    module = ModuleType("hspec_baseline_packing")
    exec(compile(text, f"{commit}:{PACKING}", "exec"), module.__dict__)  # noqa: S102 - a commit of this repository
    return module


def calls_on_copies(op, x: torch.Tensor, weight: torch.Tensor, extra: tuple, cold: bool):
    """A call of op(x, weight, *extra); with `cold`, each call on the next of its own copies of `weight`."""
    copies = [weight.clone() for _ in range(-(-COLD_BYTES // weight.numel()))] if cold else [weight]
    turn = itertools.count()
    return lambda: op(x, copies[next(turn) % len(copies)], *extra)


def time_pair(calls: dict[str, object], rounds: int) -> dict[str, float]:
    """Median thread CPU time (us) of each call, the calls alternating round by round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.thread_time()
            call()  # type: ignore[operator]
            times[name].append(time.thread_time() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit whose kernels are timed against this tree's")
    p.add_argument("--rounds", type=int, default=60, help="alternating calls per kernel, shape and rows (default 60)")
    p.add_argument("--rows", default="1,7,8", help="comma-separated row counts (default 1,7,8)")
    p.add_argument("--cold", action="store_true", help="weights read from memory at every call (module docstring)")
    p.add_argument("--out", type=Path, default=Path("results/native_drafter"))
    args = p.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    if not row_counts or min(row_counts) < 1:
        raise SystemExit(f"--rows must be positive row counts, got {args.rows!r}")
    load_beside_baseline(args.baseline)
    new, old = torch.ops.hspec, torch.ops.hspec_baseline
    old_packing = baseline_packing(args.baseline)
    torch.manual_seed(0)
    rows_out = []
    for name, n, k in SHAPES:
        q, scale = quantize_rows(torch.randn(n, k), torch.bfloat16)
        levels, steps = quantize_groups(torch.randn(n, k), torch.bfloat16)
        packed = {"w8a8": (pack_w8a8(q), old_packing.pack_w8a8(q)),
                  "w4a8": (pack_w4a8(levels, steps), old_packing.pack_w4a8(levels, steps))}
        for m in row_counts:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for kind, (weight, old_weight) in packed.items():
                now_op, before_op = (new.w8a8_linear, old.w8a8_linear) if kind == "w8a8" else \
                    (new.w4a8_linear, old.w4a8_linear)
                extra = (scale,) if kind == "w8a8" else ()
                now = calls_on_copies(now_op, x, weight, extra, args.cold)
                before = calls_on_copies(before_op, x, old_weight, extra, args.cold)

                same = torch.equal(now(), before())
                us = time_pair({"baseline": before, "this tree": now}, args.rounds)
                rows_out.append({"shape": name, "N": n, "K": k, "rows": m, "kernel": kind, "same_bits": same,
                                 "baseline_us": us["baseline"], "this_tree_us": us["this tree"]})
                print(f"{name} {kind} M={m}: {us['baseline']:.0f} -> {us['this tree']:.0f} us"
                      f"{'' if same else '  BITS DIFFER'}", flush=True)
    command = (f"python scripts/ab_products.py --baseline {args.baseline} --rounds {args.rounds} --rows {args.rows} "
               f"{'--cold ' if args.cold else ''}--out {args.out}")
    settings = {"baseline": args.baseline, "rounds": args.rounds, "rows": row_counts, "threads": 1, "cold": args.cold,
                "rows_dtype": "bfloat16", "integer_capability": integer_capability()}
    payload = {"provenance": provenance(command, settings), "results": rows_out}
    weights_read = ("weights read from memory at every call" if args.cold
                    else "weights hot in the caches after the first round")
    lines = ["# w4a8 and w8a8 products: this tree's kernels against the baseline's\n",
             provenance_markdown(payload["provenance"]),
             "\nMedian thread CPU time of one call (us), the two kernels alternating call by call in one process "
             f"(bf16 rows, one thread, {weights_read}); same bits: the two outputs equal bit for bit.\n",
             "| shape | kernel | rows | baseline (us) | this tree (us) | speedup | same bits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['rows']} | {r['baseline_us']:.0f} | "
                     f"{r['this_tree_us']:.0f} | {r['baseline_us'] / r['this_tree_us']:.2f}x | "
                     f"{'yes' if r['same_bits'] else 'NO'} |")
    write_results(args.out, "ab_products", payload, "\n".join(lines) + "\n")
    print(f"wrote {args.out}/ab_products.json and .md")
    return 0 if all(r["same_bits"] for r in rows_out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
