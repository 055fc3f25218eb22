"""Does a proposal cost more when something else ran just before it? (docs/fast-path.md#ahead-of-time-drafter)

`hspec bench draft` times each `propose(K=7)` right after a target verify, as decoding runs it; a proposal
timed back to back with the previous one is faster. This times the compiled H-Spec drafter's greedy
proposal (B = 1, context 256, random weights, the bench's setting) after each of several gaps: nothing,
the main thread spinning in Python for a few milliseconds (no memory traffic, the other thread idle),
sleeping, writing a large buffer, and a target verify. Each gap is repeated in a block (gap, proposal, gap,
proposal, ...; the first two proposals of a block are not kept, so each block times the steady state of
its gap), and the blocks of all gaps are interleaved round by round.

    .venv/bin/python scripts/propose_after_gap.py [--dtype bfloat16] [--rounds 3] [--block 10]

Writes results/ahead_of_time/propose_after_gap.{json,md} (run it on a quiet host).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hspec.bench.draft import _create, _Setting
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import for_inference

CONTEXT = 256
K = 7
SPIN_MS = (1, 2, 5, 10, 20, 50)
SWEEP_MB = (32, 256)


def spin(seconds: float) -> None:
    """Busy-wait in Python: the main thread stays on its core and touches next to no memory."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def gaps(setting: _Setting) -> dict[str, Callable[[], object]]:
    """What runs between two proposals, by name."""
    out: dict[str, Callable[[], object]] = {"nothing": lambda: None}
    out.update({f"spin {ms} ms": (lambda s: lambda: spin(s))(ms / 1000) for ms in SPIN_MS})
    out["sleep 20 ms"] = lambda: time.sleep(0.02)
    for mb in SWEEP_MB:
        buffer = torch.empty(mb * 2**18, dtype=torch.float32)  # mb MB
        out[f"write {mb} MB"] = (lambda b: lambda: b.fill_(1.0))(buffer)
    out["target verify (8 tokens)"] = setting.time_verify
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", help="the target's --dtype (default bfloat16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all gaps (default 3)")
    p.add_argument("--block", type=int, default=10, help="proposals per gap and round, 2 of them untimed (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", type=Path, default=Path("results/ahead_of_time"))
    args = p.parse_args()
    if args.rounds < 1 or args.block < 3:
        p.error(f"--rounds must be >= 1 and --block >= 3, got {args.rounds} and {args.block}")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)  # as decoding: the ahead-of-time library covers calls without autograd
    target = load_target("smollm2", dtype=args.dtype)
    drafter = for_inference(_create("hspec", target.config, target.model, 8192), target, compiled=True)
    setting = _Setting(target.model, {"hspec": drafter}, 1, CONTEXT, K, 1, seed=0)
    between = gaps(setting)
    for _ in range(5):  # compile or load the library, warm every path
        for gap in between.values():
            gap()
            setting.time_propose("hspec")
    times: dict[str, list[float]] = {name: [] for name in between}
    for _ in range(args.rounds):
        for name, gap in between.items():
            for repeat in range(args.block):
                gap()
                elapsed = setting.time_propose("hspec")
                if repeat >= 2:
                    times[name].append(elapsed)
    rows = {name: {"median_ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t), "max_ms": 1000 * max(t)}
            for name, t in times.items()}
    verify_ms = 1000 * statistics.median(setting.time_verify()[0] for _ in range(args.rounds * args.block))
    meta = provenance(f"python scripts/propose_after_gap.py --dtype {args.dtype} --rounds {args.rounds} "
                      f"--block {args.block} --threads {args.threads}",
                      {"drafter": "hspec (random weights, Vp 8192, compiled, drafter precision auto)", "B": 1,
                       "context": CONTEXT, "K": K, "dtype": args.dtype, "rounds": args.rounds, "block": args.block,
                       "threads": args.threads})
    lines = ["# A proposal after a gap\n", provenance_markdown(meta),
             f"H-Spec's `propose(K={K})` at B = 1, context {CONTEXT}, timed right after each gap (blocks of "
             f"{args.block} per gap, the last {args.block - 2} timed, {args.rounds} rounds over the gaps). An 8-token "
             f"target verify: median {verify_ms:.2f} ms.\n",
             "| before the proposal | median ms | min | max | T_D / T_T |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['max_ms']:.2f} | "
              f"{r['median_ms'] / verify_ms:.3f} |" for name, r in rows.items()]
    json_path, md_path = write_results(args.out, "propose_after_gap",
                                       {**meta, "verify_ms": verify_ms, "proposals": rows}, "\n".join(lines) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
