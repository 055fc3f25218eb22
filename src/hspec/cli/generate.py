"""`hspec generate` (one prompt, with its metrics) and `hspec demo` (the README's main job)."""

from __future__ import annotations

import argparse
import json

from hspec.cli.command import Command
from hspec.cli.options import (
    add_compile_drafter,
    add_decoding_options,
    add_drafter,
    add_drafter_precision,
    add_dtype,
    add_sampling,
    add_step_cost,
    add_target,
    check_draft_len,
    drafter_args,
    names,
    step_cost,
)

DEMO_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in three sentences why the sky is blue.",
    "Translate to French: 'The weather is nice today and we are going to the park.'",
)


def generate_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    add_target(gen)
    add_dtype(gen)
    add_drafter(gen, "ngram:auto")
    add_compile_drafter(gen)
    add_drafter_precision(gen)
    add_decoding_options(gen)
    add_step_cost(gen)
    add_sampling(gen)
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string, non-empty (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run_generate(args: argparse.Namespace) -> int:
    """Generate text for one prompt with a drafter and print it with its metrics."""
    import torch

    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter, decoding_options_of
    from hspec.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)  # validate before loading
    drafter_args(args)
    options = decoding_options_of([args.drafter], args.drafter_option)[args.drafter]
    cost = step_cost(args.step_cost)
    if "" in args.stop:  # an empty string is found at once: the text would be cut to nothing
        raise ValueError(f"--stop needs a non-empty string, got {args.stop!r}")
    target = load_target(args.target, dtype=args.dtype)
    drafter = build_drafter(args.drafter, target, args.drafter_path, compiled=args.compile_drafter,
                            precision=args.drafter_precision, options=options, K=args.k, step_cost=cost)
    decoder = SpeculativeDecoder(target.model, drafter, args.k, target.tokenizer.eos_token_ids,
                                 target.tokenizer.decode)
    prompt_ids = target.tokenizer.encode_prompt(args.prompt, raw=args.raw)
    torch.manual_seed(args.seed)
    out = decoder.generate([prompt_ids], sampling, args.max_new_tokens, stop=args.stop, seeds=[args.seed])
    seq = out.sequences[0]
    text = target.tokenizer.decode(seq.token_ids)
    if args.stop:
        from hspec.decoding.text import cut_at_stop

        text = cut_at_stop(text, args.stop)
    metrics = out.metrics()
    if args.json:
        print(json.dumps({"text": text, "finish_reason": seq.finish_reason, "drafter": args.drafter,
                          "target": target.name,
                          "dtype": target.model.dtype_name,
                          **metrics}), file=args.json_out)
        return 0
    print(text)
    mal = metrics["mean_accepted_length"]
    if metrics["K"] == 0:
        drafting = "plain decoding"
    elif mal is None:
        drafting = "no step drafted"
    else:
        drafting = f"MAL {mal:.2f} over the {metrics['drafted_share']:.0%} of steps that drafted"
    print(f"\n[{args.drafter}, K={metrics['K']}] {metrics['num_tokens']} tokens, finish={seq.finish_reason}, "
          f"{drafting}, {metrics['decode_tokens_per_s']:.1f} tok/s decoding "
          f"(prefill {metrics['prefill_s']:.2f} s), "
          f"ITL {metrics['itl_ms']:.1f} ms, draft {metrics['draft_ms_per_step']:.1f} ms/step, "
          f"verify {metrics['verify_ms_per_step']:.1f} ms/step")
    if metrics["acceptance_by_position"] and mal is not None:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in metrics["acceptance_by_position"])
        print(f"acceptance by position: {acc}")
    return 0


def demo_arguments(demo: argparse.ArgumentParser) -> None:
    add_target(demo)
    add_dtype(demo, default="fastest")
    demo.add_argument("--drafters", default="ngram,ngram:auto,hspec,hspec:auto,hspec+ngram:0.4,hspec+ngram:auto",
                      help="comma-separated drafter kinds (default ngram,ngram:auto,hspec,hspec:auto,hspec+ngram:0.4,"
                           "hspec+ngram:auto): n-gram and the shipped H-Spec drafter verifying all K drafts, and with "
                           "the draft length chosen per row and step by this machine's costs (:auto; 0 = a plain "
                           "decode step; the costs are measured once, ~10 s, and cached), and H-Spec behind prompt "
                           "lookup verifying only the drafts it is >= 0.4 sure of, or with :auto")
    demo.add_argument("--k", type=int, default=7)
    demo.add_argument("--max-new-tokens", type=int, default=128)


def run_demo(args: argparse.Namespace) -> int:
    """Run the README's demo: drafters against plain decoding on a few prompts."""
    from hspec.demo import run_demo as demo

    check_draft_len(args.k)
    return demo(args.target, names(args.drafters), args.k, args.max_new_tokens, list(DEMO_PROMPTS), dtype=args.dtype)


COMMANDS = (
    Command("generate", "generate text for one prompt, with metrics", generate_arguments, run_generate,
            description="Generate with speculative decoding; output equals the target's own."),
    Command("demo", "the README's main job: drafters vs plain decoding on a few prompts", demo_arguments, run_demo,
            description="Runs plain decoding and each drafter on a few prompts, interleaved, checks that outputs "
                        "match, and prints text, MAL, tokens/s, speedup."),
)
