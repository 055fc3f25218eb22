"""How a decode and an 8-token verify scale with the context, beside llama.cpp's decode at the same depths.

    .venv/bin/python scripts/bench_attention_scaling.py --out results/attention_scaling

hspec's target (SmolLM2, `--dtype`, one torch thread) over a pool of S random positions for each S in
--contexts: per round, interleaved, a 1-token decode and a (K+1)-token verify at every S (each rolled back),
timed by the wall clock and by this process's CPU time. Then `llama-bench` on the same model's GGUF, one
thread: decode (tg) at depth 0 and at each S. Both are medians; the CPU is shared, so a row's wall and CPU
times say how much of it ran. Writes <out>/attention_scaling.{json,md} (issue 50, item 5: an 8-token verify
at 2,048 keys <= 1.3x the same at 256; a decode at 2,048 keys at or under llama.cpp's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from hspec.cache.paged_pool import blocks_for
from hspec.integrations.llama_cpp.binaries import build_id, find_bin_dir, llama_bench
from hspec.models.loading import default_gguf_path, load_target
from hspec.provenance import provenance, provenance_markdown, write_results


def time_forward(model, ids: torch.Tensor, pool, length: int) -> tuple[float, float]:
    """Wall and CPU milliseconds of one forward of `ids` (1, T) after `length` positions, then rolled back."""
    start, cpu = time.perf_counter(), time.process_time()
    model(ids, pool, [0])
    elapsed = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
    pool.truncate(0, length)
    return elapsed


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="w4a8")
    parser.add_argument("--contexts", default="256,2048", help="comma-separated context lengths S")
    parser.add_argument("--K", type=int, default=7, help="drafted tokens: a verify is K + 1 tokens")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--llama-repeats", type=int, default=5, help="llama-bench -r (0: no llama.cpp rows)")
    parser.add_argument("--out", default="results/attention_scaling")
    args = parser.parse_args()
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    target = load_target("smollm2", dtype=args.dtype)
    model = target.model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    settings = {}
    with torch.inference_mode():
        for S in contexts:  # one pool each; K/V random and bf16-exact, as a row-invariant target writes them
            pool = model.new_pool(blocks_for(S + args.K + 1, 16), 16)
            pool.add_sequence(0)
            pool.extend([0], S)
            pool.k.copy_(torch.randn(pool.k.shape, generator=g).bfloat16())
            pool.v.copy_(torch.randn(pool.v.shape, generator=g).bfloat16())
            settings[S] = pool
        ids = torch.randint(0, vocab, (1, args.K + 1), generator=g)
        times = {(S, kind): {"wall": [], "cpu": []} for S in contexts for kind in ("decode", "verify")}
        for S, pool in settings.items():  # warm-up
            time_forward(model, ids[:, :1], pool, S)
            time_forward(model, ids, pool, S)
        load_before = os.getloadavg()
        for _ in range(args.repeats):
            for S, pool in settings.items():
                for kind, width in (("decode", 1), ("verify", args.K + 1)):
                    wall, cpu = time_forward(model, ids[:, :width], pool, S)
                    times[(S, kind)]["wall"].append(wall)
                    times[(S, kind)]["cpu"].append(cpu)
        load_after = os.getloadavg()
    hspec_rows = [{"S": S, "kind": kind, "tokens": 1 if kind == "decode" else args.K + 1,
                   "wall_ms": summary(t["wall"]), "cpu_ms": summary(t["cpu"])} for (S, kind), t in times.items()]
    llama_rows, llama_build = [], None
    bin_dir = find_bin_dir()
    if bin_dir is not None and args.llama_repeats > 0:
        llama_build = build_id(bin_dir)
        for row in llama_bench(bin_dir, default_gguf_path(), 1, [], 64, [0, *contexts], args.llama_repeats):
            if row.get("n_gen", 0) > 0:
                llama_rows.append({"depth": row["n_depth"], "tokens": row["n_gen"], "tok_s": row["avg_ts"],
                                   "tok_s_stddev": row["stddev_ts"], "ms_per_token": 1000 / row["avg_ts"]})
    command = (f"python scripts/bench_attention_scaling.py --dtype {args.dtype} --contexts {args.contexts} "
               f"--K {args.K} --repeats {args.repeats} --llama-repeats {args.llama_repeats} --out {args.out}")
    payload = {"provenance": provenance(command, {"dtype": model.dtype_name, "K": args.K, "repeats": args.repeats,
                                                  "threads": 1, "contexts": contexts}),
               "load_average": {"before": load_before, "after": load_after}, "llama_cpp_build": llama_build,
               "hspec": hspec_rows, "llama_cpp": llama_rows}
    md = _markdown(payload, contexts, args.K)
    json_path, md_path = write_results(Path(args.out), "attention_scaling", payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _markdown(payload: dict, contexts: list[int], K: int) -> str:
    rows = {(r["S"], r["kind"]): r for r in payload["hspec"]}
    lines = ["# Decode and verify by context, hspec beside llama.cpp\n", provenance_markdown(payload["provenance"]),
             f"- load average (1, 5, 15 min) before hspec's rounds {payload['load_average']['before']}, after "
             f"{payload['load_average']['after']}",
             f"- llama.cpp: {payload['llama_cpp_build']}\n",
             "hspec, one torch thread, medians (min-max) of interleaved rounds; wall-clock and CPU time:\n",
             f"| S (keys) | decode wall ms | decode CPU ms | verify (K+1 = {K + 1}) wall ms | verify CPU ms |",
             "|---:|---:|---:|---:|---:|"]
    for S in contexts:
        d, v = rows[(S, "decode")], rows[(S, "verify")]
        cells = [f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"
                 for x in (d["wall_ms"], d["cpu_ms"], v["wall_ms"], v["cpu_ms"])]
        lines.append(f"| {S} | " + " | ".join(cells) + " |")
    first, last = contexts[0], contexts[-1]
    for clock in ("wall_ms", "cpu_ms"):
        ratio = rows[(last, "verify")][clock]["median"] / rows[(first, "verify")][clock]["median"]
        lines.append(f"\nverify at {last} / verify at {first} ({clock[:-3]}): **{ratio:.2f}x** (goal <= 1.3x)")
    if payload["llama_cpp"]:
        lines += ["\nllama.cpp `llama-bench -p 0 -n 64 -t 1` (its wall clock), decode ms per token:\n",
                  "| depth | tok/s | ms/token | hspec decode at that S, wall / CPU ms |", "|---:|---:|---:|---:|"]
        for r in payload["llama_cpp"]:
            ours = rows.get((r["depth"], "decode"))
            mine = f"{ours['wall_ms']['median']:.2f} / {ours['cpu_ms']['median']:.2f}" if ours else "-"
            lines.append(f"| {r['depth']} | {r['tok_s']:.2f} ± {r['tok_s_stddev']:.2f} | {r['ms_per_token']:.2f} "
                         f"| {mine} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
