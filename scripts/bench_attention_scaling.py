"""How a decode and an 8-token verify scale with the context, beside llama.cpp's decode at the same depths.

    .venv/bin/python scripts/bench_attention_scaling.py --out results/attention_scaling
    .venv/bin/python scripts/bench_attention_scaling.py --pools float32,bfloat16 --contexts 256,1024,2048 \
        --llama-repeats 0 --fidelity-items 6 --out results/attention_scaling/bf16_pool

hspec's target (SmolLM2, `--dtype`, one torch thread) over a pool of S random positions for each S in
--contexts and each KV pool dtype in --pools (`own`: the model's, `TargetModel.kv_dtype`): per round,
interleaved, a 1-token decode and a (K+1)-token verify at every S over every pool (each rolled back), timed
by the wall clock and by this process's CPU time. Then `llama-bench` on the same model's GGUF, one thread:
decode (tg) at depth 0 and at each S. Both are medians; the CPU is shared, so a row's wall and CPU times say
how much of it ran. With --fidelity-items, the first and each other pool then decode Spec-Bench items
greedily (prefill, then one token at a time): how many tokens agree and whether their logits are the same
bits. Writes <out>/attention_scaling.{json,md} (issue 50, item 5: an 8-token verify at 2,048 keys <= 1.3x
the same at 256; a decode at 2,048 keys at or under llama.cpp's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from hspec.cache.paged_pool import PagedKVPool, pages_for
from hspec.data.tasks import load_task
from hspec.integrations.llama_cpp.binaries import build_id, find_bin_dir, llama_bench
from hspec.models.dtype import dtype_name
from hspec.models.llama import TargetModel
from hspec.models.loading import default_gguf_path, load_target
from hspec.provenance import provenance, provenance_markdown, write_results

POOL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def new_pool(model: TargetModel, num_pages: int, pool: str) -> PagedKVPool:
    """The model's own pool (`pool` "own") or one in another dtype laid out as the model lays out its own."""
    if pool == "own":
        return model.new_pool(num_pages, 16)
    c = model.config
    return PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_pages, 16, dtype=POOL_DTYPES[pool],
                       device=model.embed_tokens.weight.device, transposed_k=model.row_invariant_attention,
                       product_dtype=model.kv_product_dtype)


def pool_label(model: TargetModel, pool: str) -> str:
    return f"own ({dtype_name(model.kv_dtype)})" if pool == "own" else pool


def time_forward(model, ids: torch.Tensor, pool, length: int) -> tuple[float, float]:
    """Wall and CPU milliseconds of one forward of `ids` (1, T) after `length` positions, then rolled back."""
    start, cpu = time.perf_counter(), time.process_time()
    model(ids, pool, [0])
    elapsed = (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000
    pool.truncate(0, length)
    return elapsed


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def greedy_logits(model: TargetModel, prompt: list[int], tokens: int, pool_name: str
                  ) -> tuple[list[int], torch.Tensor]:
    """`tokens` greedy tokens after `prompt` over a fresh pool (a prefill, then 1-token decodes) and the
    logits (tokens, V) that chose them."""
    pool = new_pool(model, pages_for(len(prompt) + tokens + 1, 16), pool_name)
    pool.add_sequence(0)
    logits = [model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1]]
    path = [int(logits[-1].argmax())]
    while len(path) < tokens:
        logits.append(model(torch.tensor([[path[-1]]]), pool, [0]).logits[0, -1])
        path.append(int(logits[-1].argmax()))
    return path, torch.stack(logits)


def fidelity(model: TargetModel, prompts: list[list[int]], tokens: int, pools: list[str]) -> list[dict]:
    """Per prompt and per pool after the first: greedy tokens equal to the first pool's before the first
    difference, and whether every logit up to there has the same bits (else the largest difference)."""
    rows = []
    for i, prompt in enumerate(prompts):
        reference, reference_logits = greedy_logits(model, prompt, tokens, pools[0])
        for pool in pools[1:]:
            path, logits = greedy_logits(model, prompt, tokens, pool)
            same = next((j for j, (a, b) in enumerate(zip(reference, path)) if a != b), tokens)
            upto = max(same, 1)
            rows.append({"item": i, "prompt_tokens": len(prompt), "pool": pool, "against": pools[0],
                         "tokens": tokens, "tokens_before_first_difference": same,
                         "logits_bit_identical": bool(torch.equal(logits[:upto], reference_logits[:upto])),
                         "max_abs_logit_difference": float((logits[:upto].float()
                                                            - reference_logits[:upto].float()).abs().max())})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="w4a8")
    parser.add_argument("--contexts", default="256,2048", help="comma-separated context lengths S")
    parser.add_argument("--K", type=int, default=7, help="drafted tokens: a verify is K + 1 tokens")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--llama-repeats", type=int, default=5, help="llama-bench -r (0: no llama.cpp rows)")
    parser.add_argument("--pools", default="own",
                        help="comma-separated KV pool dtypes timed side by side: own (the model's), float32, bfloat16")
    parser.add_argument("--fidelity-items", type=int, default=0,
                        help="Spec-Bench items each pool decodes greedily, compared with the first pool (0: none)")
    parser.add_argument("--fidelity-tokens", type=int, default=64, help="greedy tokens per fidelity item")
    parser.add_argument("--out", default="results/attention_scaling")
    args = parser.parse_args()
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    pools = args.pools.split(",")
    unknown = [p for p in pools if p != "own" and p not in POOL_DTYPES]
    if unknown:
        parser.error(f"--pools: unknown {unknown}; choose from own, {', '.join(POOL_DTYPES)}")
    target = load_target("smollm2", dtype=args.dtype)
    model = target.model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    settings = {}
    with torch.inference_mode():
        for S in contexts:  # one pool each; K/V random and bf16-exact, as a row-invariant target writes them
            c = model.config
            k = torch.randn((c.num_layers, S + args.K + 1, c.num_kv_heads, c.head_dim), generator=g).bfloat16()
            v = torch.randn(k.shape, generator=g).bfloat16()
            for name in pools:  # the same values in every pool
                pool = new_pool(model, pages_for(S + args.K + 1, 16), name)
                pool.add_sequence(0)
                pool.k[:, : k.shape[1]].copy_(k)
                pool.v[:, : v.shape[1]].copy_(v)
                pool.extend([0], S)
                settings[(name, S)] = pool
        ids = torch.randint(0, vocab, (1, args.K + 1), generator=g)
        times = {(name, S, kind): {"wall": [], "cpu": []}
                 for S in contexts for name in pools for kind in ("decode", "verify")}
        for (_, S), pool in settings.items():  # warm-up
            time_forward(model, ids[:, :1], pool, S)
            time_forward(model, ids, pool, S)
        load_before = os.getloadavg()
        for _ in range(args.repeats):
            for (name, S), pool in settings.items():
                for kind, width in (("decode", 1), ("verify", args.K + 1)):
                    wall, cpu = time_forward(model, ids[:, :width], pool, S)
                    times[(name, S, kind)]["wall"].append(wall)
                    times[(name, S, kind)]["cpu"].append(cpu)
        load_after = os.getloadavg()
        fidelity_rows = []
        if args.fidelity_items > 0:
            items = load_task("spec_bench", args.fidelity_items).items
            prompts = [target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}]) for item in items]
            fidelity_rows = fidelity(model, prompts, args.fidelity_tokens, pools)
    hspec_rows = [{"pool": pool_label(model, name), "S": S, "kind": kind,
                   "tokens": 1 if kind == "decode" else args.K + 1, "wall_ms": summary(t["wall"]),
                   "cpu_ms": summary(t["cpu"])} for (name, S, kind), t in times.items()]
    llama_rows, llama_build = [], None
    bin_dir = find_bin_dir()
    if bin_dir is not None and args.llama_repeats > 0:
        llama_build = build_id(bin_dir)
        for row in llama_bench(bin_dir, default_gguf_path(), 1, [], 64, [0, *contexts], args.llama_repeats):
            if row.get("n_gen", 0) > 0:
                llama_rows.append({"depth": row["n_depth"], "tokens": row["n_gen"], "tok_s": row["avg_ts"],
                                   "tok_s_stddev": row["stddev_ts"], "ms_per_token": 1000 / row["avg_ts"]})
    command = (f"python scripts/bench_attention_scaling.py --dtype {args.dtype} --contexts {args.contexts} "
               f"--K {args.K} --repeats {args.repeats} --llama-repeats {args.llama_repeats} --pools {args.pools} "
               f"--fidelity-items {args.fidelity_items} --fidelity-tokens {args.fidelity_tokens} --out {args.out}")
    labels = [pool_label(model, name) for name in pools]
    payload = {"provenance": provenance(command, {"dtype": model.dtype_name, "K": args.K, "repeats": args.repeats,
                                                  "threads": 1, "contexts": contexts, "pools": labels}),
               "load_average": {"before": load_before, "after": load_after}, "llama_cpp_build": llama_build,
               "hspec": hspec_rows, "llama_cpp": llama_rows, "fidelity": fidelity_rows}
    md = _markdown(payload, contexts, labels, args.K)
    json_path, md_path = write_results(Path(args.out), "attention_scaling", payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _markdown(payload: dict, contexts: list[int], pools: list[str], K: int) -> str:
    rows = {(r["pool"], r["S"], r["kind"]): r for r in payload["hspec"]}
    lines = ["# Decode and verify by context, hspec beside llama.cpp\n", provenance_markdown(payload["provenance"]),
             f"- load average (1, 5, 15 min) before hspec's rounds {payload['load_average']['before']}, after "
             f"{payload['load_average']['after']}",
             f"- llama.cpp: {payload['llama_cpp_build']}\n",
             "hspec, one torch thread, medians (min-max) of interleaved rounds; wall-clock and CPU time:\n",
             f"| KV pool | S (keys) | decode wall ms | decode CPU ms | verify (K+1 = {K + 1}) wall ms "
             "| verify CPU ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for pool in pools:
        for S in contexts:
            d, v = rows[(pool, S, "decode")], rows[(pool, S, "verify")]
            cells = [f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"
                     for x in (d["wall_ms"], d["cpu_ms"], v["wall_ms"], v["cpu_ms"])]
            lines.append(f"| {pool} | {S} | " + " | ".join(cells) + " |")
    first, last = contexts[0], contexts[-1]
    for pool in pools:
        for clock in ("wall_ms", "cpu_ms"):
            ratio = rows[(pool, last, "verify")][clock]["median"] / rows[(pool, first, "verify")][clock]["median"]
            lines.append(f"\n{pool} pool: verify at {last} / verify at {first} ({clock[:-3]}): **{ratio:.2f}x** "
                         "(goal <= 1.3x)")
    if len(pools) > 1:
        lines += [f"\nCPU time over the {pools[0]} pool's, same S and forward:\n",
                  "| KV pool | S (keys) | decode | verify |", "|---|---:|---:|---:|"]
        for pool in pools[1:]:
            for S in contexts:
                ratios = [rows[(pool, S, kind)]["cpu_ms"]["median"] / rows[(pools[0], S, kind)]["cpu_ms"]["median"]
                          for kind in ("decode", "verify")]
                lines.append(f"| {pool} | {S} | {ratios[0]:.2f}x | {ratios[1]:.2f}x |")
    if payload["fidelity"]:
        lines += ["\nFidelity: Spec-Bench items decoded greedily over each pool (prefill, then one token at a time), "
                  "against the first pool:\n",
                  "| item | prompt tokens | KV pool | tokens before the first difference | logits the same bits | "
                  "max abs logit difference |", "|---:|---:|---|---:|---|---:|"]
        for r in payload["fidelity"]:
            lines.append(f"| {r['item']} | {r['prompt_tokens']} | {r['pool']} | {r['tokens_before_first_difference']}"
                         f" of {r['tokens']} | {'yes' if r['logits_bit_identical'] else 'no'} | "
                         f"{r['max_abs_logit_difference']:.3g} |")
    if payload["llama_cpp"]:
        lines += ["\nllama.cpp `llama-bench -p 0 -n 64 -t 1` (its wall clock), decode ms per token:\n",
                  f"| depth | tok/s | ms/token | hspec decode at that S ({pools[0]} pool), wall / CPU ms |",
                  "|---:|---:|---:|---:|"]
        for r in payload["llama_cpp"]:
            ours = rows.get((pools[0], r["depth"], "decode"))
            mine = f"{ours['wall_ms']['median']:.2f} / {ours['cpu_ms']['median']:.2f}" if ours else "-"
            lines.append(f"| {r['depth']} | {r['tok_s']:.2f} ± {r['tok_s_stddev']:.2f} | {r['ms_per_token']:.2f} "
                         f"| {mine} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
