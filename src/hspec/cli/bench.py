"""`hspec bench decode|serve|vllm|vllm-serve|draft|train`: the benchmarks that write results/*.json and *.md."""

from __future__ import annotations

import argparse

from hspec.cli.command import Command, group
from hspec.cli.options import (
    add_compile_drafter,
    add_data_dir,
    add_drafter_precision,
    add_dtype,
    add_floating_dtype,
    add_pool_options,
    add_target,
    add_training_precision,
    check_draft_len,
    dtype_name,
    ints,
    names,
    split_kind_path,
)


def decode_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4",
                   help="comma-separated dtypes to time (auto, float32, bfloat16, int8, int4, w4a8; default "
                        "float32,bfloat16,int8,int4)")
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers column")
    p.add_argument("--max-prompt-tokens", type=int, default=128,
                   help="keep each decoded prompt's first N tokens (its prefill is not timed; default 128)")
    p.add_argument("--prefill-tokens", default="128,512",
                   help="prompt lengths whose prefill is timed in every runtime (the Spec-Bench prompts run "
                        "together and cut to length; default 128,512)")
    p.add_argument("--num-prompts", type=int, default=2, help="Spec-Bench prompts (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens per prompt and runtime, >= 2; the first comes from the untimed prefill (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared 2-core host, 2 threads stall on each other's "
                        "neighbours; 0 = torch's default)")
    p.add_argument("--out", default="results", help="output directory")
    add_data_dir(p)


def run_bench_decode(args: argparse.Namespace) -> int:
    """Benchmark plain decoding per dtype and the verify cost against K."""
    from hspec.bench.decode import run_decode_bench

    return run_decode_bench(args.target, args.num_prompts, args.max_new_tokens, args.repeats, args.out,
                            data_dir=args.data_dir, dtypes=[dtype_name(d) for d in names(args.dtypes)],
                            transformers=not args.no_transformers, max_prompt_tokens=args.max_prompt_tokens,
                            threads=args.threads, prefill_tokens=ints(args.prefill_tokens))


def serve_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    add_dtype(p)
    p.add_argument("--drafters", default="none,ngram",
                   help="comma-separated kinds to serve, a trained one optionally as KIND=DIR with its checkpoint "
                        "(default none,ngram; none = plain decoding)")
    p.add_argument("--concurrency", default="8,16,32,64,128", help="comma-separated client counts")
    p.add_argument("--k", type=int, default=7, help="tokens drafted per step (default 7)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--level-seconds", type=float, default=60.0,
                   help="time bound per level and kind: no new requests after it (default 60)")
    p.add_argument("--tasks", default="spec_bench", help="comma-separated prompt sets (default spec_bench)")
    p.add_argument("--num-prompts", type=int, default=240, help="items per task (default 240)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (default 256)")
    p.add_argument("--server-threads", type=int, default=0,
                   help="torch threads of each server (default 0 = torch's default)")
    p.add_argument("--drafter-path", action="append", default=[], metavar="KIND=DIR",
                   help="trained checkpoint for a kind (repeatable; as --drafters KIND=DIR); default: the one "
                        "shipped for the target")
    p.add_argument("--random-drafter-weights", action="store_true",
                   help="serve trained kinds untrained where no checkpoint exists (timing / KV only)")
    add_pool_options(p, default_budget_mib=256.0)
    p.add_argument("--spec-max-batch", default="none", metavar="LIST",
                   help="comma-separated `hspec serve --spec-max-batch` values, `none` = always speculate; "
                        "each drafting kind is served once per value, beside the others (default none)")
    p.add_argument("--name", default="serve_bench",
                   help="stem of the result files (default serve_bench; other names prefix the plots too)")
    p.add_argument("--out", default="results", help="output directory; files go to <out>/serving/")
    add_data_dir(p)


def run_bench_serve(args: argparse.Namespace) -> int:
    """Benchmark the server under load: throughput, latency and KV use."""
    from hspec.bench.serve import ServeBenchSettings, run_serve_bench

    check_draft_len(args.k)
    drafters = [split_kind_path(spec) for spec in names(args.drafters)]
    paths = [(kind, path) for kind, path in drafters if path is not None] + [kind_path(x) for x in args.drafter_path]
    settings = ServeBenchSettings(
        target=args.target, dtype=args.dtype, drafters=tuple(kind for kind, _ in drafters),
        concurrency=concurrency(args.concurrency), K=args.k, max_tokens=args.max_tokens,
        level_seconds=args.level_seconds, tasks=tuple(names(args.tasks)),
        num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens, kv_budget_mib=args.kv_budget_mib,
        page_size=args.page_size, max_running=args.max_running,
        speculate_max_batch=spec_limits(args.spec_max_batch), server_threads=args.server_threads, out=args.out,
        name=args.name,
        random_drafter_weights=args.random_drafter_weights,
        drafter_paths=tuple(paths), data_dir=args.data_dir)
    return run_serve_bench(settings, args.command_line)


# The --spec-max-batch value that sets no limit (speculate at every batch size).
NO_LIMIT = "none"


def spec_limits(text: str) -> tuple[int | None, ...]:
    """'none,2' -> (None, 2); raises ValueError naming --spec-max-batch."""
    try:
        return tuple(None if x.strip() == NO_LIMIT else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--spec-max-batch must be comma-separated integers >= 0 or `none`, got {text!r}") from None


def concurrency(text: str) -> tuple[int, ...]:
    """'8,16' -> (8, 16); raises ValueError naming --concurrency."""
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError as err:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from err


def kind_path(text: str) -> tuple[str, str]:
    """'KIND=DIR' -> (KIND, DIR); raises ValueError naming --drafter-path."""
    kind, path = split_kind_path(text)
    if path is None:
        raise ValueError(f"--drafter-path must look like KIND=DIR, got {text!r}")
    return kind, path


def vllm_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    p.add_argument("--drafters", default="none,ngram,dflash=random",
                   help="comma-separated: none (vLLM plain, always run), ngram, suffix (vLLM's suffix decoding; "
                        "needs arctic-inference==0.1.1, a source build), dflash=PATH (an hspec DFlash "
                        "checkpoint, exported for vLLM on the fly, or such an export), dflash=random (seed-0 random "
                        "weights: losslessness and KV cost, not tau), peagle=PATH or peagle=random (hspec's P-Eagle "
                        "as vLLM's parallel EAGLE-3), hspec (the shipped H-Spec drafter as a vLLM "
                        "proposer) or hspec=PATH (an hspec H-Spec checkpoint); hspec:P keeps each request's drafts "
                        "of confidence >= P, hspec@B drafts at most B tokens per step over the batch (both combine: "
                        "hspec:0.4@64=PATH), hspec:auto gives each request the draft length that pays most per "
                        "step cost, timed on the engine's own steps once per machine; default none,ngram,dflash=random")
    p.add_argument("--prompts-file", default=None, metavar="F.jsonl",
                   help='one {"prompt": "..."} per line, chat-templated like `hspec generate` '
                        "(default: --num-prompts evenly spaced Spec-Bench items)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts to use (default 4; 0 = the whole file)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_floating_dtype(p, ("float32", "bfloat16"), "float32",
                       "vLLM's compute dtype; greedy equality is exact only in float32")
    p.add_argument("--k", type=int, default=5,
                   help="drafts per step for ngram (default 5; DFlash: its export's; H-Spec: its checkpoint's "
                        "trained draft length)")
    p.add_argument("--max-model-len", type=int, default=1024, help="vLLM's max_model_len (default 1024)")
    p.add_argument("--no-hspec-engine", action="store_true", help="skip the rows of hspec's own engine")
    p.add_argument("--hspec-dtype", type=dtype_name, choices=("float32", "bfloat16", "int8", "int4", "w4a8"),
                   default="float32",
                   help="dtype of hspec's own engine (default float32, where its tau and outputs are compared "
                        "exactly with vLLM's float32 run; bfloat16, int8, int4 or w4a8 to race vLLM)")
    p.add_argument("--hspec-methods", default="",
                   help="comma-separated hspec drafters run only in hspec's engine, e.g. hspec+ngram:0.4 "
                        "(none already runs)")
    p.add_argument("--hspec-k", type=int, default=7, help="K of the --hspec-methods rows (default 7)")
    p.add_argument("--threads", type=int, default=2,
                   help="CPU threads of every vLLM engine and of hspec's engine alike (default 2)")
    p.add_argument("--name", default=None, help="file stem of the results (default vllm_<dtype>)")
    p.add_argument("--json", action="store_true",
                   help="print the rows as JSON on stdout, vLLM's logs on stderr, instead of writing results/vllm/")
    p.add_argument("--out", default="results/vllm", help="output directory (default results/vllm)")
    add_data_dir(p)


def run_bench_vllm(args: argparse.Namespace) -> int:
    """Benchmark drafters inside vLLM: greedy equality with vLLM plain decoding, tau, tok/s, KV capacity."""
    from hspec.bench.vllm import HspecSide, run_vllm_bench

    check_draft_len(args.hspec_k, "--hspec-k")
    hspec = HspecSide(args.hspec_dtype, tuple(names(args.hspec_methods)), args.hspec_k)
    return run_vllm_bench(args.target, args.drafters, args.prompts_file, args.num_prompts,
                          args.max_new_tokens, args.dtype, args.k, args.max_model_len, args.out,
                          args.json_out if args.json else None,
                          data_dir=args.data_dir, hspec_engine=not args.no_hspec_engine, hspec=hspec, name=args.name,
                          threads=args.threads)


def vllm_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    p.add_argument("--drafters", default="none,ngram,hspec",
                   help="as `hspec bench vllm --drafters`: none (always run), ngram, suffix, dflash=PATH, "
                        "dflash=random, peagle=PATH, peagle=random, hspec, hspec=PATH, hspec:P, hspec@B (at most B "
                        "drafts per step over the batch) (default none,ngram,hspec)")
    p.add_argument("--concurrency", default="8,16,32,64", help="comma-separated levels (default 8,16,32,64)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per level (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--prompts-file", default=None, metavar="F.jsonl",
                   help='one {"prompt": "..."} per line (default: evenly spaced Spec-Bench items)')
    add_floating_dtype(p, ("float32", "bfloat16"), "float32",
                       "compute dtype of every server (float32: outputs must equal batch 1)")
    p.add_argument("--k", type=int, default=5, help="drafts per step for ngram (default 5)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="vLLM's max_model_len; prompt + --max-tokens must fit (default 2048)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of every server in GiB (default 1)")
    p.add_argument("--threads", type=int, default=2,
                   help="OpenMP/torch threads per server; servers run one at a time (default 2)")
    p.add_argument("--no-hspec-engine", action="store_true", help="skip the `hspec serve` rows")
    p.add_argument("--out", default="results/vllm", help="output directory (default results/vllm)")
    p.add_argument("--name", default=None, help="file stem of the results (default serve_<dtype>)")
    add_data_dir(p)


def run_bench_vllm_serve(args: argparse.Namespace) -> int:
    """Benchmark serving throughput, latency and KV use vs concurrency through vLLM's OpenAI server."""
    from hspec.bench.vllm_serve import VllmServeSettings, run_vllm_serve_bench

    settings = VllmServeSettings(
        target=args.target, drafters=args.drafters, concurrency=tuple(ints(args.concurrency)),
        num_requests=args.num_requests, max_tokens=args.max_tokens, dtype=args.dtype, K=args.k,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
        prompts_file=args.prompts_file, hspec_engine=not args.no_hspec_engine, out=args.out, name=args.name,
        data_dir=args.data_dir)
    return run_vllm_serve_bench(settings, args.command_line)


def draft_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    add_dtype(p)
    p.add_argument("--drafters", default="", help="comma-separated kinds (default: every registered kind)")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated B (default 1,16)")
    p.add_argument("--contexts", default="256,2048", help="comma-separated context lengths (default 256,2048)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="pruned draft vocabulary Vp of every trained kind (default: the paper's 32,000)")
    add_compile_drafter(p)
    add_drafter_precision(p)
    p.add_argument("--breakdown", action="store_true",
                   help="instead: H-Spec's native proposal (B = 1) timed section by section against the verify")
    p.add_argument("--out", default="results", help="output directory")


def run_bench_draft(args: argparse.Namespace) -> int:
    """Benchmark the draft forward cost T_D(K) against the verify cost T_T per drafter kind."""
    from hspec.bench.draft import run_draft_bench

    if args.breakdown:
        from hspec.bench.draft_breakdown import run_draft_breakdown

        return run_draft_breakdown(args.target, args.out, ints(args.contexts), args.repeats,
                                   draft_vocab_size=args.draft_vocab, dtype=args.dtype,
                                   drafter_precision=args.drafter_precision)
    return run_draft_bench(args.target, names(args.drafters), args.out, args.repeats,
                           ints(args.batch_sizes), ints(args.contexts), draft_vocab_size=args.draft_vocab,
                           dtype=args.dtype, compile_drafters=args.compile_drafter,
                           drafter_precision=args.drafter_precision)


def train_arguments(p: argparse.ArgumentParser) -> None:
    add_target(p)
    p.add_argument("--drafter", default="hspec", help="drafter kind to train (default hspec)")
    p.add_argument("--features", default="runs/features/part1", help="feature cache dir(s), comma-separated")
    p.add_argument("--corpus", default="results/train_data/corpus_part1.jsonl",
                   help="corpus the first --features dir is built from when it does not exist yet")
    p.add_argument("--draft-vocab", type=int, default=8192, help="pruned draft vocabulary Vp (default 8192)")
    p.add_argument("--seqs-per-step", default="4", help="axis: comma-separated sequences per step (default 4)")
    p.add_argument("--anchors-per-seq", default="16", help="axis: comma-separated anchors per sequence (default 16)")
    add_training_precision(p, "axis: comma-separated fp32, bf16-autocast", default="bf16-autocast", axis=True)
    p.add_argument("--lr", default="6e-4", help="axis: comma-separated peak learning rates (default 6e-4)")
    p.add_argument("--compile", default="off", help="axis: off, on or off,on: the step's forward and loss through "
                                                    "torch.compile (compiled in the untimed round 0)")
    p.add_argument("--blocks", type=int, default=2048, help="blocks each configuration trains (default 2048)")
    p.add_argument("--round-blocks", type=int, default=None,
                   help="blocks per interleaved round (default: one step of the largest configuration)")
    p.add_argument("--val-sequences", type=int, default=8, help="held-out sequences validated on (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default 1)")
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU when visible), cpu, cuda or cuda:N")
    p.add_argument("--out", default="results/train_throughput", help="output directory")
    p.add_argument("--name", default=None, help="stem of the result files (default train_throughput_<cpu|gpu>)")


def run_bench_train(args: argparse.Namespace) -> int:
    """Benchmark the trainer's configurations against each other (blocks/s and loss per block)."""
    from pathlib import Path

    import torch

    from hspec.bench.train import bench_configs, run_train_bench
    precisions, switches = args.precision, {"off": False, "on": True}  # the precisions parsed by argparse
    if not names(args.compile) or set(names(args.compile)) - set(switches):
        raise ValueError(f"--compile takes off, on or off,on, got {args.compile!r}")
    torch.set_num_threads(args.threads)
    configs = bench_configs(ints(args.seqs_per_step), ints(args.anchors_per_seq), precisions,
                            [float(x) for x in names(args.lr)], [switches[x] for x in names(args.compile)])
    name = args.name or f"train_throughput_{'gpu' if args.device != 'cpu' and torch.cuda.is_available() else 'cpu'}"
    _, md = run_train_bench(args.target, args.drafter, [Path(f) for f in names(args.features)],
                            Path(args.corpus) if args.corpus else None, configs, args.blocks, args.round_blocks,
                            Path(args.out), name, args.command_line, args.draft_vocab, args.val_sequences,
                            args.seed, args.device)
    print(f"wrote {md}")
    return 0


BENCH_COMMANDS = (
    Command("decode", "plain decode per dtype vs transformers; verify cost vs K", decode_arguments, run_bench_decode,
            description="Interleaved plain-decode ms/token of this runtime in each --dtypes entry, of its float32 "
                        "runtime before stacked projections, of transformers' eager generate and of llama.cpp when "
                        "installed; the cost of a (K+1)-token verify over a 1-token decode per dtype; the prefill "
                        "time of --prefill-tokens prompts in every runtime. Writes <out>/decode_cpu.{json,md}."),
    Command("serve", "closed-loop serving throughput and KV utilisation vs concurrency (paper Fig. 6)",
            serve_arguments, run_bench_serve,
            description="Starts one `hspec serve` per drafter kind on 127.0.0.1 with the same KV memory budget, "
                        "then for each concurrency level runs C closed-loop HTTP clients (greedy chat requests over "
                        "eval-set prompts) against each server in turn for --level-seconds. Writes "
                        "<out>/serving/serve_bench.{json,md}, throughput_vs_concurrency.png, kv_vs_concurrency.png "
                        "and the KV capacity in tokens per drafter kind at the budget."),
    Command("vllm", "drafters inside vLLM (CPU build): greedy equality with vLLM plain, tau, tok/s, KV capacity",
            vllm_arguments, run_bench_vllm,
            description="Batch-1 greedy decoding of the target in vLLM with each drafter, interleaved prompt by "
                        "prompt, plus hspec's own engine on the same token ids. Needs vLLM: `bash "
                        "scripts/install_vllm.sh` (docs/vllm.md). Without --json writes results/vllm/vllm_<dtype>.json "
                        "and .md with provenance."),
    Command("vllm-serve", "serving throughput vs concurrency through vLLM's OpenAI server, and hspec serve",
            vllm_serve_arguments, run_bench_vllm_serve,
            description="Starts vLLM's OpenAI server once per --drafters configuration (then `hspec serve` with the "
                        "matching drafter), sends the same --num-requests greedy chat requests at each --concurrency, "
                        "and records output tok/s, latency and TTFT p50/p90, KV use and capacity, tau, and outputs "
                        "equal to vLLM plain at batch 1. Writes <out>/serve_<dtype>.{json,md} and "
                        "serve_<dtype>_throughput.png. Needs vLLM (docs/vllm.md)."),
    Command("draft", "draft forward cost T_D(K) / verify cost T_T per drafter kind", draft_arguments, run_bench_draft,
            description="Interleaved timing of one propose(K=7) per kind against the target's 8-token verify, for "
                        "several batch sizes and contexts (random drafter weights); writes "
                        "results/draft_cost_<device>.*"),
    Command("train", "trainer throughput (blocks/s, ms/step) and loss per block, configurations interleaved",
            train_arguments, run_bench_train,
            description="Trains one drafter kind in every combination of the axes below from the same initial "
                        "weights on the same number of blocks, in interleaved rounds (round 0 untimed); reports "
                        "blocks/s, ms/step, the training loss by round, held-out loss and validation tau at the "
                        "end (hspec/bench/train.py). Runs on a CUDA GPU under --device auto when one is visible."),
)

COMMANDS = (Command("bench", "benchmarks that write results/*.json and *.md", group(BENCH_COMMANDS, "bench")),)
