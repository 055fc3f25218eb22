"""The glue kernels of a decode and a verify, this tree's against another commit's, interleaved in one process.

`hspec::rope_and_write` (RoPE of the new tokens' queries and keys, their K/V written to a bf16 pool layer kept
K-transposed) and `hspec::rms_norm` (two a layer), from this tree (torch.ops.hspec) and from `--baseline`'s
models/cpu_kernels.cpp built beside it (torch.ops.hspec_baseline, as scripts/ab_products.py builds it), and the
greedy argmax of the LM head's bf16 logits: `hspec::greedy_tokens` against `logits.float().argmax(-1)` (what
`sampling.greedy_tokens` ran before it). SmolLM2-135M's shapes (Hq 9, Hkv 3, D 64, H 576, V 49,152), T = 1, 4
and 8 rows, calls alternating, thread CPU time, medians; each pair's outputs (and pool writes) compared bit for
bit.

    python scripts/ab_glue.py --baseline 87da03c [--rounds 200] [--out results/verify_breakdown]

Writes <out>/ab_glue.{json,md}. One thread (OMP_NUM_THREADS=1 is set before torch loads).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from ab_products import load_beside_baseline, time_pair  # noqa: E402

from hspec.models.layers import rope_cos_sin  # noqa: E402
from hspec.models.native import integer_capability  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402

HQ, HKV, D, H, V = 9, 3, 64, 576, 49152
ROWS = (1, 4, 8)
CONTEXT = 2048  # the slots written sit after this many keys


def _rope_pair(ops_new, ops_old, t: int, gen: torch.Generator):
    """A forward's 30 calls by each side, writing to pools of their own, and whether their queries and pools
    agree after one call each."""
    projected = torch.randn(t, (HQ + 2 * HKV) * D, generator=gen).bfloat16()  # (T, (Hq + 2 Hkv) D)
    positions = CONTEXT + torch.arange(t)[None]  # (1, T)
    cos, sin = (table[:, :, None] for table in rope_cos_sin(1e4 ** -(torch.arange(0, D, 2) / D), positions,
                                                            torch.bfloat16))  # (1, T, 1, D)
    slots = CONTEXT + torch.arange(t)
    pools = [(torch.zeros(HKV, D, CONTEXT + 16, dtype=torch.bfloat16).permute(2, 0, 1),  # (slots, Hkv, D), K^T
              torch.zeros(CONTEXT + 16, HKV, D, dtype=torch.bfloat16)) for _ in range(2)]

    def call(ops, pool):
        return lambda: ops.rope_and_write(projected, cos, sin, pool[0], pool[1], slots, HQ, HKV)

    def same() -> bool:
        q_new, q_old = call(ops_new, pools[0])(), call(ops_old, pools[1])()
        return (torch.equal(q_new, q_old) and torch.equal(pools[0][0], pools[1][0])
                and torch.equal(pools[0][1], pools[1][1]))
    new_call, old_call = call(ops_new, pools[0]), call(ops_old, pools[1])
    return lambda: [old_call() for _ in range(30)], lambda: [new_call() for _ in range(30)], same()


def _norm_pair(ops_new, ops_old, x: torch.Tensor, gain: torch.Tensor):
    """A forward's 60 norms of x (T, H) by each side, and whether one call of each agrees."""
    same = torch.equal(ops_new.rms_norm(x, gain, 1e-5), ops_old.rms_norm(x, gain, 1e-5))
    return (lambda: [ops_old.rms_norm(x, gain, 1e-5) for _ in range(60)],
            lambda: [ops_new.rms_norm(x, gain, 1e-5) for _ in range(60)], same)


def _argmax_pair(ops_new, logits: torch.Tensor):
    """torch's argmax of the fp32 copy against hspec::greedy_tokens, and whether they agree."""
    same = torch.equal(logits.float().argmax(-1), ops_new.greedy_tokens(logits))
    return lambda: logits.float().argmax(-1), lambda: ops_new.greedy_tokens(logits), same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit whose glue kernels are timed against this tree's")
    p.add_argument("--rounds", type=int, default=200, help="alternating calls per kernel and rows (default 200)")
    p.add_argument("--out", type=Path, default=Path("results/verify_breakdown"))
    args = p.parse_args(argv)
    load_beside_baseline(args.baseline)
    new, old = torch.ops.hspec, torch.ops.hspec_baseline
    gen = torch.Generator().manual_seed(0)
    results = []
    for t in ROWS:
        x = torch.randn(t, H, generator=gen).bfloat16()  # (T, H)
        gain = (1 + 0.1 * torch.randn(H, generator=gen)).bfloat16()  # (H,)
        logits = (3 * torch.randn(1, t, V, generator=gen)).bfloat16()  # (1, T, V)
        pairs = {"rope_and_write (30 layers)": _rope_pair(new, old, t, gen),
                 "rms_norm (60 a forward)": _norm_pair(new, old, x, gain),
                 "greedy argmax (torch's -> hspec::greedy_tokens)": _argmax_pair(new, logits)}
        for name, (before, now, same) in pairs.items():
            us = time_pair({"baseline": before, "this tree": now}, args.rounds)
            results.append({"kernel": name, "rows": t, "same_bits": same, "baseline_us": us["baseline"],
                            "this_tree_us": us["this tree"]})
            print(f"{name} T={t}: {us['baseline']:.1f} -> {us['this tree']:.1f} us{'' if same else '  DIFFER'}",
                  flush=True)
    command = "python scripts/ab_glue.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    settings = {"baseline": args.baseline, "rounds": args.rounds, "threads": 1,
                "integer_capability": integer_capability(), "load_average": load}
    payload = {"provenance": provenance(command.strip(), settings), "results": results}
    lines = ["# Glue kernels: this tree's against the baseline's\n", provenance_markdown(payload["provenance"]),
             "\nMedian thread CPU time (us) of the calls one forward makes (rope_and_write once a layer, rms_norm "
             "twice), the two sides alternating in one process; same: outputs (and pool writes) equal bit for bit. "
             "The argmax's baseline is torch's `logits.float().argmax(-1)` on (1, T, 49,152) bf16 logits.\n",
             "| kernel | rows | baseline (us) | this tree (us) | speedup | same |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['kernel']} | {r['rows']} | {r['baseline_us']:.1f} | {r['this_tree_us']:.1f} | "
                     f"{r['baseline_us'] / r['this_tree_us']:.2f}x | {'yes' if r['same_bits'] else 'NO'} |")
    write_results(args.out, "ab_glue", payload, "\n".join(lines) + "\n")
    print(f"wrote {args.out}/ab_glue.json and .md")
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
