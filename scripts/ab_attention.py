"""hspec's attention kernel of this tree against another commit's, interleaved in one process (issue 50, item 5).

A change to `hspec::attention` must keep every output's bits (docs/fast-path.md) and is worth landing only if
it is faster. Like scripts/ab_products.py, this builds the other commit's models/cpu_kernels.cpp as a second
library (`hspec_baseline::`), checks both kernels' outputs equal bit for bit over decode, causal verify and
tree (random mask) rows, bf16 and fp32 K/V, head dims 16, 64 and 128, then times a forward's 30 attention
calls (w4a8 SmolLM2-135M's shapes: 9 query heads over 3 KV heads, D = 64, each layer's own bf16 K/V laid out
as the target's pool lays them out, K transposed, 47 MB at 2,048 keys, so they come from memory as a
forward's do) for a decode and an 8-token verify at 256 and 2,048 keys, and the verify over the first
layer's K/V 30 times (hot in the L2 cache: what streaming them from memory costs): thread CPU time of the
30 calls, baseline and this tree alternating round by round, medians.

    .venv/bin/python scripts/ab_attention.py --baseline 19c30c6 [--rounds 41] [--out results/attention_scaling/passes]

Writes <out>/ab_attention.{json,md}. One thread (OMP_NUM_THREADS=1 is set before torch loads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from ab_products import load_beside_baseline  # noqa: E402  (the baseline commit's kernels, renamed and built)

from hspec.models.native import integer_capability  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402

LAYERS, HQ, HKV, DIM, TOKENS = 30, 9, 3, 64, 8
CONTEXTS = (256, 2048)
# (S keys, T query tokens, Hq, Hkv, D) of the bit checks: full and partial key blocks, every head dim path
BIT_CASES = [(2048, 8, 9, 3, 64), (37, 3, 4, 2, 64), (300, 5, 8, 8, 16), (129, 1, 9, 3, 64), (1000, 8, 6, 2, 128)]


def bit_checks(new, old, g: torch.Generator) -> list[dict[str, object]]:
    """Per case, dtype and mask (none, causal, tree): whether both kernels' outputs are equal bit for bit."""
    checks = []
    for dtype in (torch.bfloat16, torch.float32):
        for s, t, hq, hkv, d in BIT_CASES:
            q = (3 * torch.randn((2, t, hq, d), generator=g)).to(dtype)  # (B, T, Hq, D)
            k = (3 * torch.randn((2, s, hkv, d), generator=g)).to(dtype)  # (B, S, Hkv, D)
            v = torch.randn((2, s, hkv, d), generator=g).to(dtype)
            causal = torch.ones((2, 1, t, s), dtype=torch.bool).tril(s - t)  # (B, 1, T, S)
            tree = causal & (torch.rand((2, 1, t, s), generator=g) < 0.7)
            tree[..., 0] = True
            for name, mask in (("none", None), ("causal", causal), ("tree", tree)):
                a, b = new(q, k, v, mask, s), old(q, k, v, mask, s)
                same = torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                checks.append({"S": s, "T": t, "Hq": hq, "Hkv": hkv, "D": d, "dtype": str(dtype).split(".")[-1],
                               "mask": name, "same_bits": same})
    return checks


def pool_layers(s: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SmolLM2's LAYERS layers of random bf16 K/V over s positions, K^T as the pool keeps it: k (1, S, Hkv, D)
    over memory laid out (1, Hkv, D, S), v (1, S, Hkv, D)."""
    return [(torch.randn((1, HKV, DIM, s), generator=g).bfloat16().permute(0, 3, 1, 2),
             torch.randn((1, s, HKV, DIM), generator=g).bfloat16()) for _ in range(LAYERS)]


def causal_queries(t: int, s: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The last t of s positions as a verify's (or, t = 1, a decode's) queries (1, T, Hq, D) bf16 and their mask
    (1, 1, T, S): row i sees keys < S - T + i + 1."""
    return torch.randn((1, t, HQ, DIM), generator=g).bfloat16(), torch.ones((1, 1, t, s), dtype=torch.bool).tril(s - t)


def forward_calls(new, old, g: torch.Generator) -> dict[tuple[int, str, str], object]:
    """(S, decode or verify, side) -> a forward's 30 attention calls, one per layer over its own K/V."""
    calls = {}
    for s in CONTEXTS:
        layers = pool_layers(s, g)
        for kind, t in (("decode", 1), ("verify", TOKENS)):
            q, mask = causal_queries(t, s, g)
            for side, op in (("baseline", old), ("this tree", new)):
                calls[(s, kind, side)] = lambda op=op, q=q, mask=mask, s=s, layers=layers: [
                    op(q, k, v, mask, s) for k, v in layers]
                if kind == "verify":  # the first layer's K/V 30 times: hot in the L2 cache after the first call
                    calls[(s, "verify, K/V hot", side)] = lambda op=op, q=q, mask=mask, s=s, kv=layers[0]: [
                        op(q, *kv, mask, s) for _ in range(LAYERS)]
    return calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="19c30c6", help="the commit whose kernel is timed against this tree's")
    p.add_argument("--rounds", type=int, default=41, help="alternating rounds of every call (default 41)")
    p.add_argument("--out", type=Path, default=Path("results/attention_scaling/passes"))
    args = p.parse_args()
    load_beside_baseline(args.baseline)
    new, old = torch.ops.hspec.attention, torch.ops.hspec_baseline.attention
    g = torch.Generator().manual_seed(0)
    checks = bit_checks(new, old, g)
    calls = forward_calls(new, old, g)
    times: dict[tuple[int, str, str], list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(args.rounds):
            for key, call in calls.items():
                start = time.thread_time()
                call()
                times[key].append(time.thread_time() - start)
    rows = []
    for s in CONTEXTS:
        for kind in ("decode", "verify", "verify, K/V hot"):
            before = 1e3 * statistics.median(times[(s, kind, "baseline")])
            now = 1e3 * statistics.median(times[(s, kind, "this tree")])
            rows.append({"S": s, "call": kind, "baseline_ms": before, "this_tree_ms": now})
            print(f"S={s} {kind}: {before:.2f} -> {now:.2f} ms", flush=True)
    same = all(c["same_bits"] for c in checks)
    print(f"bit checks: {sum(c['same_bits'] for c in checks)}/{len(checks)} equal")
    command = f"python scripts/ab_attention.py --baseline {args.baseline} --rounds {args.rounds} --out {args.out}"
    settings = {"baseline": args.baseline, "rounds": args.rounds, "threads": 1, "kv_dtype": "bfloat16",
                "shapes": f"{LAYERS} layers, Hq {HQ}, Hkv {HKV}, D {DIM}, verify of {TOKENS} tokens",
                "integer_capability": integer_capability(), "load_average": Path("/proc/loadavg").read_text().strip()}
    payload = {"provenance": provenance(command, settings), "results": rows, "bit_checks": checks}
    lines = ["# hspec::attention: this tree's kernel against the baseline's\n",
             provenance_markdown(payload["provenance"]),
             "\nMedian thread CPU time of a forward's 30 attention calls (ms; each layer's own bf16 K/V, from memory; "
             "\"K/V hot\": the first layer's 30 times, from the L2 cache), the two kernels alternating round by "
             "round in one process, one thread.\n",
             "| keys S | call | baseline (ms) | this tree (ms) | speedup |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['call']} | {r['baseline_ms']:.2f} | {r['this_tree_ms']:.2f} | "
                     f"{r['baseline_ms'] / r['this_tree_ms']:.2f}x |")
    lines += ["", f"Same bits: {sum(c['same_bits'] for c in checks)} of {len(checks)} outputs equal bit for bit "
              "(bf16 and fp32 K/V; S, T, Hq, Hkv, D in " + ", ".join(str(c) for c in BIT_CASES) +
              "; no mask, causal, tree)."]
    write_results(args.out, "ab_attention", payload, "\n".join(lines) + "\n")
    print(f"wrote {args.out}/ab_attention.json and .md")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
