"""The `hspec` command line. This is the only module that reads argv; each command calls library code."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

DEMO_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in three sentences why the sky is blue.",
    "Translate to French: 'The weather is nice today and we are going to the park.'",
)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="HF checkpoint dir (config.json + *.safetensors), a .gguf file, or 'smollm2' "
                        "(the embedded default, SmolLM2-135M-Instruct; default)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k best tokens; 0 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the random draws")


def _add_drafter(p: argparse.ArgumentParser, default: str) -> None:
    from hspec.drafters import DRAFTERS

    p.add_argument("--drafter", default=default,
                   help=f"drafter kind: {', '.join(DRAFTERS.names())} (default {default}; none = plain decoding)")
    p.add_argument("--k", type=int, default=7, help="tokens drafted per step, K >= 1 (default 7)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hspec", description="Lossless speculative decoding with the H-Spec drafter and its baselines.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, with metrics",
                         description="Generate with speculative decoding; output equals the target's own.")
    gen.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    _add_target(gen)
    _add_drafter(gen, "ngram")
    _add_sampling(gen)
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    demo = sub.add_parser("demo", help="the README's main job: drafters vs plain decoding on a few prompts",
                          description="Runs plain decoding and each drafter on a few prompts, interleaved, "
                                      "checks that outputs match, and prints text, MAL, tokens/s, speedup.")
    _add_target(demo)
    demo.add_argument("--drafters", default="ngram", help="comma-separated drafter kinds (default ngram)")
    demo.add_argument("--k", type=int, default=7)
    demo.add_argument("--max-new-tokens", type=int, default=128)

    data = sub.add_parser("data", help="training data: the target's own responses")
    data_sub = data.add_subparsers(dest="data", required=True)
    dgen = data_sub.add_parser("generate", help="generate the target's responses to training prompts (resumable)",
                               description="Batched greedy (or sampled) responses of the target to the training "
                                           "prompts, appended to a JSONL file; rerun the same command to resume.")
    _add_target(dgen)
    dgen.add_argument("--prompts", default="train_prompts.jsonl",
                      help="prompt JSONL (normalized format), a path or a file in the shared data dir")
    dgen.add_argument("--num-prompts", type=int, default=None, help="how many prompts (default all)")
    dgen.add_argument("--max-prompt-tokens", type=int, default=384)
    dgen.add_argument("--max-new-tokens", type=int, default=256)
    dgen.add_argument("--batch-size", type=int, default=16)
    _add_sampling(dgen)
    dgen.add_argument("--out", default="runs/data/smollm2_responses.jsonl", help="output JSONL")

    bench = sub.add_parser("bench", help="benchmarks that write results/*.json and *.md")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bdec = bench_sub.add_parser("decode", help="plain-decode ITL vs transformers; verify cost vs K",
                                description="Interleaved plain-decode ITL of this runtime vs transformers' "
                                            "eager generate, and the cost of a (K+1)-token verify.")
    _add_target(bdec)
    bdec.add_argument("--num-prompts", type=int, default=4)
    bdec.add_argument("--max-new-tokens", type=int, default=64)
    bdec.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    bdec.add_argument("--out", default="results", help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            from hspec.demo import run_demo

            return run_demo(args.target, [k for k in args.drafters.split(",") if k], args.k,
                            args.max_new_tokens, list(DEMO_PROMPTS))
        if args.command == "data" and args.data == "generate":
            from pathlib import Path

            from hspec.training.datagen import DataGenSettings, generate_corpus

            settings = DataGenSettings(args.target, args.prompts, args.num_prompts, args.max_prompt_tokens,
                                       args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                                       args.batch_size, args.seed)
            print(f"wrote {generate_corpus(settings, Path(args.out))}")
            return 0
        if args.command == "bench" and args.bench == "decode":
            from hspec.bench.decode import run_decode_bench

            return run_decode_bench(args.target, args.num_prompts, args.max_new_tokens, args.repeats, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"hspec: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.decoding.sampling import SamplingParams
    from hspec.drafters import create_drafter
    from hspec.models.loading import load_target

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)  # validate before loading
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    target = load_target(args.target)
    drafter = create_drafter(args.drafter, target.config)
    decoder = SpeculativeDecoder(target.model, drafter, args.k, target.tokenizer.eos_token_ids,
                                 target.tokenizer.decode)
    prompt_ids = target.tokenizer.encode_prompt(args.prompt, raw=args.raw)
    torch.manual_seed(args.seed)
    out = decoder.generate([prompt_ids], sampling, args.max_new_tokens, stop=args.stop, seeds=[args.seed])
    seq = out.sequences[0]
    text = target.tokenizer.decode(seq.token_ids)
    if args.stop:
        text = _cut_at_stop(text, args.stop)
    metrics = out.metrics()
    if args.json:
        print(json.dumps({"text": text, "finish_reason": seq.finish_reason, "drafter": args.drafter,
                          "target": target.name, **metrics}))
        return 0
    print(text)
    print(f"\n[{args.drafter}, K={metrics['K']}] {metrics['num_tokens']} tokens, finish={seq.finish_reason}, "
          f"MAL {metrics['mean_accepted_length']:.2f}, {metrics['tokens_per_s']:.1f} tok/s, "
          f"ITL {metrics['itl_ms']:.1f} ms, draft {metrics['draft_ms_per_step']:.1f} ms/step, "
          f"verify {metrics['verify_ms_per_step']:.1f} ms/step")
    if metrics["acceptance_by_position"]:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in metrics["acceptance_by_position"])
        print(f"acceptance by position: {acc}")
    return 0


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


if __name__ == "__main__":
    sys.exit(main())
