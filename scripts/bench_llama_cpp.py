"""llama.cpp's own binaries beside hspec on the same Spec-Bench prompts (docs/llama-cpp.md).

    .venv/bin/python scripts/bench_llama_cpp.py --drafter dspark=runs/train/dspark/drafter --num-prompts 12

Needs the binaries of scripts/build_llama_cpp.sh. Every prompt is chat-templated by hspec's tokenizer and
sent to llama.cpp as token ids, so every engine decodes the same ids; EOS is ignored so every row emits
exactly --max-new-tokens tokens. One `llama-server` per configuration, all started first and warmed up,
then prompt by prompt every configuration in turn (machine noise hits every row alike):

- llama.cpp plain, and each of its n-gram types (`--spec-type ngram-*`, their default settings);
- llama.cpp with each `--drafter KIND=CHECKPOINT` exported by `hspec export-gguf` (`draft-dspark`, the
  layout hspec trains), and for a `dflash` one also under `draft-dflash` (z-lab's layout: drafts land one
  position off, which the tau of that row shows);
- hspec's engine: plain in `--hspec-dtype` (w4a8 by default, hspec's fastest CPU path), each of
  `--hspec-drafters` in that dtype (the shipped H-Spec drafter, the cost-aware lengths: hspec's best rows), and
  each `--drafter` in float32 on the same ids (its tau against llama.cpp's).

Per row: decode tokens/s (llama.cpp's own clock: `predicted_ms` over predicted_n - 1 steps; hspec's decode
phase), prefill tokens/s (llama.cpp's `prompt_ms`; hspec's prefill), tau from each engine's own counters
(tokens per target forward, bonus included), and how many prompts' outputs equal llama.cpp plain's token for
token; hspec's drafted rows are also checked against hspec's plain row of their dtype (`= own plain`: the
lossless claim, since hspec's w4a8 rounds otherwise than llama.cpp's Q4_1). A last line puts the fastest row of
each engine side by side. Then `llama-bench` on the target alone: prefill (pp) and decode at depths (tg @ d). Writes
<out>/<name>.json and .md with the command, commit, CPU features and llama.cpp's build id.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hspec.bench.vllm import read_prompts
from hspec.integrations.llama_cpp.binaries import Completion, LlamaServer, build_id, find_bin_dir, llama_bench
from hspec.integrations.llama_cpp.export import SPEC_TYPE, export_gguf
from hspec.models.loading import default_gguf_path, load_target, resolve_target_dir
from hspec.provenance import provenance, provenance_markdown, write_results

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def llama_rows(name: str, runs: list[Completion], plain: list[list[int]], args: list[str]) -> dict[str, Any]:
    """One llama.cpp row from its completions of every prompt."""
    decode = [c.decode_tok_s for c in runs]
    generated = sum(c.predicted_n - 1 for c in runs)
    steps = sum(c.target_steps for c in runs)
    drafted = sum(c.draft_n for c in runs)
    accepted = sum(c.draft_accepted for c in runs)
    return {"engine": "llama.cpp", "config": name, "args": " ".join(args),
            "decode_tok_s_median": statistics.median(decode),
            "prefill_tok_s_median": statistics.median(c.prefill_tok_s for c in runs),
            "prompt_tokens_median": statistics.median(c.prompt_n for c in runs),
            "tau": generated / steps if drafted else 1.0,
            "acceptance": accepted / drafted if drafted else None,
            "drafted": drafted, "accepted": accepted,
            "equal_plain": sum(c.tokens == p for c, p in zip(runs, plain)), "prompts": len(runs),
            "decode_tok_s": decode}


def hspec_run(target: Any, kind: str, path: Path | None, k: int, ids: list[int], n: int) -> dict[str, Any]:
    """hspec's engine on one prompt, EOS ignored: tokens, prefill and decode times, drafted/accepted."""
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    key = (id(target), kind, path, k)
    if key not in _decoders:
        _decoders[key] = SpeculativeDecoder(target.model, build_drafter(kind, target, path), max(k, 1), ())
    out = _decoders[key].generate([ids], SamplingParams(), n)
    seq = out.sequences[0]
    return {"tokens": list(seq.token_ids), "prefill_s": out.prefill_s, "decode_s": out.decode_s,
            "steps": len(seq.num_accepted), "accepted": sum(seq.num_accepted),
            "drafted": sum(seq.num_drafted)}


_decoders: dict[tuple, Any] = {}


def hspec_row(name: str, runs: list[dict[str, Any]], plain: list[list[int]], prompt_lens: list[int],
              own_plain: list[list[int]] | None = None) -> dict[str, Any]:
    """One hspec row; `own_plain`: hspec's plain outputs in the row's dtype, which a drafted row must equal."""
    decode = [(len(r["tokens"]) - 1) / r["decode_s"] for r in runs]
    steps = sum(r["steps"] for r in runs)
    return {"engine": "hspec", "config": name, "args": "",
            "decode_tok_s_median": statistics.median(decode),
            "prefill_tok_s_median": statistics.median(n / r["prefill_s"] for n, r in zip(prompt_lens, runs)),
            "prompt_tokens_median": statistics.median(prompt_lens),
            "tau": (sum(r["accepted"] for r in runs) + steps) / steps if steps else 1.0,
            "acceptance": (sum(r["accepted"] for r in runs) / max(1, sum(r["drafted"] for r in runs))),
            "drafted": sum(r["drafted"] for r in runs), "accepted": sum(r["accepted"] for r in runs),
            "equal_plain": sum(r["tokens"] == p for r, p in zip(runs, plain)), "prompts": len(runs),
            "equal_own_plain": (None if own_plain is None else
                                sum(r["tokens"] == p for r, p in zip(runs, own_plain))),
            "decode_tok_s": decode}


def fastest(rows: list[dict[str, Any]], engine: str) -> dict[str, Any] | None:
    """The row of `engine` with the highest median decode tokens/s."""
    mine = [r for r in rows if r["engine"] == engine]
    return max(mine, key=lambda r: r["decode_tok_s_median"]) if mine else None


def render(meta: dict[str, Any], rows: list[dict[str, Any]], bench: list[dict[str, Any]]) -> str:
    plain = rows[0]["decode_tok_s_median"]
    lines = ["# llama.cpp's own binaries beside hspec", "", provenance_markdown(meta),
             f"- llama.cpp: {meta['llama_cpp_build']} (`{meta['bin_dir']}`)", "",
             f"{meta['settings']['num_prompts']} Spec-Bench prompts (chat-templated token ids, the same for every "
             f"engine), {meta['settings']['max_new_tokens']} tokens each, EOS ignored, greedy, "
             f"{meta['settings']['threads']} threads. Decode: median over prompts of tokens/s after the first token "
             "(llama.cpp: its `predicted_ms`; hspec: its decode phase). Prefill: median prompt tokens/s of the same "
             "requests. tau: tokens per target forward from each engine's own counters. `= plain`: prompts whose "
             "output equals llama.cpp plain's token for token; `= own plain`: an hspec row's outputs equal to hspec's "
             "plain row of its dtype.", "",
             "| engine | configuration | decode tok/s | x llama.cpp plain | prefill tok/s | tau | acceptance "
             "| = plain | = own plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        own = "-" if r.get("equal_own_plain") is None else f"{r['equal_own_plain']}/{r['prompts']}"
        lines.append(f"| {r['engine']} | {r['config']} | {r['decode_tok_s_median']:.1f} | "
                     f"{r['decode_tok_s_median'] / plain:.2f}x | {r['prefill_tok_s_median']:.0f} | {r['tau']:.3f} | "
                     f"{acc} | {r['equal_plain']}/{r['prompts']} | {own} |")
    best_hspec, best_llama = fastest(rows, "hspec"), fastest(rows, "llama.cpp")
    if best_hspec and best_llama:
        lines += ["", f"Fastest of each engine: hspec {best_hspec['config']} "
                  f"{best_hspec['decode_tok_s_median']:.1f} tok/s against llama.cpp {best_llama['config']} "
                  f"{best_llama['decode_tok_s_median']:.1f} tok/s: "
                  f"**{best_hspec['decode_tok_s_median'] / best_llama['decode_tok_s_median']:.2f}x** (decode phase)."]
    if bench:
        lines += ["", "`llama-bench` on the target alone (llama.cpp's mean ± stddev over its repetitions):", "",
                  "| test | tokens/s |", "|---|---:|"]
        for b in bench:
            test = f"pp{b['n_prompt']}" if b["n_prompt"] else f"tg{b['n_gen']} @ d{b['n_depth']}"
            lines.append(f"| {test} | {b['avg_ts']:.1f} ± {b['stddev_ts']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-gguf", default=None, help="target GGUF (default: the embedded SmolLM2 one)")
    p.add_argument("--drafter", action="append", default=[], metavar="KIND=CHECKPOINT",
                   help="an hspec dflash/dspark checkpoint, exported with hspec export-gguf (repeatable)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ngram-types", default=",".join(NGRAM_TYPES))
    p.add_argument("--hspec-dtype", default="w4a8", help="dtype of hspec's plain and drafted rows (default w4a8)")
    p.add_argument("--hspec-drafters", default="ngram:auto,hspec:auto,hspec+ngram:0.4,hspec+ngram:auto",
                   help="hspec drafter strings run in --hspec-dtype with the shipped drafter ('' = none)")
    p.add_argument("--k", type=int, default=7, help="draft length of --hspec-drafters (at most, for :auto)")
    p.add_argument("--no-hspec", action="store_true", help="llama.cpp rows only")
    p.add_argument("--bench-prompt", default="512,2048", help="llama-bench prefill sizes ('' = skip llama-bench)")
    p.add_argument("--bench-depths", default="64,512,1024,2048", help="llama-bench decode depths")
    p.add_argument("--bench-gen", type=int, default=128)
    p.add_argument("--name", default="llama_cpp_cpu")
    p.add_argument("--out", default="results/llama_cpp")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)

    # A SIGTERM ends the run through the `finally` below, so no llama-server outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bin_dir = find_bin_dir()
    if bin_dir is None:
        sys.exit("llama.cpp's binaries are not built: bash scripts/build_llama_cpp.sh")
    torch.set_num_threads(args.threads)
    target_gguf = Path(args.target_gguf) if args.target_gguf else default_gguf_path()
    # the embedded default by its name, so that the drafters shipped for it are found
    target_name = None if args.target_gguf is None else str(target_gguf)
    target = load_target(target_name, "float32")
    prompts = [target.tokenizer.encode_prompt(text) for text in read_prompts(None, args.num_prompts, args.data_dir)]
    n = args.max_new_tokens
    drafters = [tuple(d.split("=", 1)) for d in args.drafter]
    work = Path(tempfile.mkdtemp(prefix="bench_llama_cpp_"))

    configs: dict[str, list[str]] = {"plain": []}
    for t in [t for t in args.ngram_types.split(",") if t]:
        configs[t] = ["--spec-type", t]
    for kind, path in drafters:
        _, target_dir = resolve_target_dir(str(target_gguf))
        exported = export_gguf(path, work / f"{kind}.gguf", target_gguf, target_dir, dtype="f32")
        configs[f"{kind} (hspec drafter, {SPEC_TYPE})"] = exported.llama_cli_args(target_gguf)[2:]
        if kind == "dflash":
            configs[f"{kind} (hspec drafter, draft-dflash: z-lab layout)"] = [
                "-md", str(exported.path), "--spec-type", "draft-dflash",
                "--spec-draft-n-max", str(exported.max_draft_len - 1)]

    servers = {name: LlamaServer(bin_dir, target_gguf, extra, threads=args.threads,
                                 log_path=work / f"server_{i}.log").__enter__()
               for i, (name, extra) in enumerate(configs.items())}
    runs: dict[str, list[Completion]] = {name: [] for name in configs}
    hspec_runs: dict[str, list[dict[str, Any]]] = {}
    hspec_targets: dict[str, tuple[Any, str, Path | None, int]] = {}
    drafted_in_fast_dtype: list[str] = []  # the rows checked against hspec's own plain row
    if not args.no_hspec:
        fast = load_target(target_name, args.hspec_dtype)
        hspec_targets[f"plain {args.hspec_dtype}"] = (fast, "none", None, 1)
        for kind in [d for d in args.hspec_drafters.split(",") if d]:
            drafted_in_fast_dtype.append(f"{kind} {args.hspec_dtype}, K={args.k}")
            hspec_targets[drafted_in_fast_dtype[-1]] = (fast, kind, None, args.k)
        for kind, path in drafters:
            from hspec.drafters.checkpoint import read_checkpoint

            k = read_checkpoint(Path(path)).drafter_config.max_draft_len
            hspec_targets[f"{kind} float32, K={k}"] = (target, kind, Path(path), k)
        hspec_runs = {name: [] for name in hspec_targets}
    try:
        for server in servers.values():  # warm-up
            server.complete(prompts[0][:16], 8)
        with torch.inference_mode():
            for spec in hspec_targets.values():
                hspec_run(*spec, prompts[0][:16], 8)
            for i, ids in enumerate(prompts):
                start = time.perf_counter()
                for name, server in servers.items():
                    runs[name].append(server.complete(ids, n))
                for name, spec in hspec_targets.items():
                    hspec_runs[name].append(hspec_run(*spec, ids, n))
                print(f"prompt {i + 1}/{len(prompts)} ({len(ids)} tokens, {time.perf_counter() - start:.0f} s): "
                      + ", ".join(f"{k} {v[-1].decode_tok_s:.0f}" for k, v in runs.items()) + " tok/s", flush=True)
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
    plain_tokens = [c.tokens for c in runs["plain"]]
    rows = [llama_rows(name, runs[name], plain_tokens, configs[name]) for name in configs]
    prompt_lens = [len(ids) for ids in prompts]
    own_plain = [r["tokens"] for r in hspec_runs.get(f"plain {args.hspec_dtype}", [])]
    rows += [hspec_row(name, runs_, plain_tokens, prompt_lens,
                       own_plain if name in drafted_in_fast_dtype else None)
             for name, runs_ in hspec_runs.items()]
    bench = []
    if args.bench_prompt:
        bench = llama_bench(bin_dir, target_gguf, args.threads, [int(x) for x in args.bench_prompt.split(",")],
                            args.bench_gen, [int(x) for x in args.bench_depths.split(",")])
        bench = [{k: b[k] for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts")} for b in bench]
    settings = {"target_gguf": str(target_gguf), "num_prompts": len(prompts), "max_new_tokens": n,
                "threads": args.threads, "drafters": dict(drafters), "hspec_dtype": args.hspec_dtype,
                "hspec_drafters": args.hspec_drafters, "k": args.k}
    meta = provenance("python scripts/bench_llama_cpp.py " + " ".join(sys.argv[1:] if argv is None else argv),
                      settings)
    meta.update(llama_cpp_build=build_id(bin_dir), bin_dir=str(bin_dir))
    paths = write_results(Path(args.out), args.name, {"meta": meta, "rows": rows, "llama_bench": bench},
                          render(meta, rows, bench))
    print(f"wrote {paths[0]} and {paths[1]}")
    shutil.rmtree(work)  # the exported GGUFs and server logs (kept when the run fails, for the logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
