"""The `hspec` command line. This is the only module that reads argv; each command calls library code."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hspec.console import json_stdout

DEMO_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in three sentences why the sky is blue.",
    "Translate to French: 'The weather is nice today and we are going to the park.'",
)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="HF checkpoint dir (config.json + *.safetensors), a .gguf file, or 'smollm2' "
                        "(the embedded default, SmolLM2-135M-Instruct; default)")


def _add_dtype(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--dtype", default=default,
                   choices=("auto", "fastest", "float32", "bfloat16", "int8", "int4", "w4a8"),
                   help=f"weights, KV pool and drafters (default {default}): auto = bfloat16 on a GPU or a CPU with "
                        "native "
                        "bf16 dot products (AVX512-BF16 or AMX), float32 on other CPUs, where bf16 runs slower; "
                        "int8 = the target's linear weights stored as int8 (one scale per row) with bf16 "
                        "activations; int4 = its decoder layers' weights in 4-bit groups of 32 (the default "
                        "GGUF's own Q4_1 levels) and an int8 LM head, with bf16 activations; w4a8 = int4's weights "
                        "with each product's input rows rounded to int8 blocks of 32 (integer dot products, as "
                        "llama.cpp's Q4_1 x Q8_1; needs an x86-64 CPU with AVX2), the fastest plain decoding on a "
                        "CPU; fastest = w4a8 where hspec's CPU kernels run, else auto. int8, int4 and w4a8 are "
                        "slightly different models, so auto never picks them (docs/guide/dtypes.md)")


def _add_compile_drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-drafter", action="store_true",
                   help="run trained drafters' block forward and greedy loop through torch.compile (inductor), "
                        "and for one sequence on a CPU through AOTInductor libraries (no guards, no Python between "
                        "kernels; ~30-40 s to compile once, then loaded from ~/.cache/hspec): on a 2-core CPU under "
                        "half the eager drafting time, a quarter less than torch.compile alone; drafts may round "
                        "differently, the output never changes (docs/fast-path.md#compiled-drafter, "
                        "#ahead-of-time-drafter)")


def _add_drafter_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-precision", default="auto", choices=("auto", "floating", "int8"),
                   help="how trained drafters store their linear weights: auto (default) = int8 under a bfloat16, "
                        "int8 or int4 target on a CPU, where drafting is bound by reading the drafter's weights, else "
                        "the target's floating dtype; floating; int8 (one scale per row, computing in the "
                        "target's dtype). Drafts may change, the output never does (docs/fast-path.md#int8-drafter)")


def _add_step_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-cost", default=None, metavar="DRAFT,PER_TOKEN,PER_TOKEN_KEY",
                   help="the step costs `:auto` drafters choose their draft length by, in 1-token decodes: the "
                        "draft, each verified token at no context, and its growth per key of context (e.g. "
                        "0.6,0.13,8e-5); default: this machine's, measured on first use (~10 s) and cached under "
                        "~/.cache/hspec/step_costs/ (docs/guide/generate.md)")


def _step_cost(text: str | None):
    """`--step-cost` parsed before anything loads (None: measured)."""
    from hspec.drafters.step_cost import StepCost

    return None if text is None else StepCost.parse(text)


def _add_decoding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="set a decoding option of a trained drafter's saved config (repeatable): a field that "
                        "changes how it drafts, not its weights, e.g. SpecBlock's tree costs for this machine "
                        "(tree_cost_per_node=0.0, adapt_tree=false, node_budget=8: docs/drafters.md); it applies "
                        "to every drafter whose kind has the field, and a key none has lists what each takes")


def _add_device(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--device", default=default,
                   help=f"auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N; under torchrun "
                        f"cuda means each process's own GPU (default {default})")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k best tokens; 0 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the random draws")


def _add_drafter(p: argparse.ArgumentParser, default: str) -> None:
    from hspec.drafters import DRAFTERS

    p.add_argument("--drafter", default=default,
                   help=f"drafter kind: {', '.join(DRAFTERS.names())} (default {default}; none = plain decoding); "
                        "KIND+ngram (e.g. hspec+ngram) drafts by prompt lookup when the last token occurred "
                        "before, by KIND otherwise; a :P suffix (e.g. hspec+ngram:0.4) verifies only the leading "
                        "drafts the drafter is at least P sure of (K stays the most per step), and behind lookup "
                        "2m+1 drafts after an m-token match")
    p.add_argument("--k", type=int, default=7,
                   help=f"tokens drafted per step, 1 <= K <= {MAX_DRAFT_LEN}; a trained drafter allows at most the "
                        "K it was trained for (7 for the shipped ones) (default 7)")
    p.add_argument("--drafter-path", default=None,
                   help="trained drafter checkpoint dir (default: the one shipped for the embedded target); "
                        "only for trained kinds, not none or ngram")


# The most tokens a step may draft. The target verifies K+1 tokens per step, so a step costs more with
# every draft while acceptance falls off fast with the position (few steps accept 8 tokens here); trained
# drafters allow at most their trained draft length anyway (7 shipped; the paper trains up to 16). 32 leaves
# room for long prompt-lookup copies and stops the likes of --k 5000 (half a minute per step on a CPU).
MAX_DRAFT_LEN = 32


def _check_draft_len(K: int, flag: str = "--k") -> None:
    """Raise ValueError unless the draft length K given by `flag` is in 1..MAX_DRAFT_LEN."""
    if not 1 <= K <= MAX_DRAFT_LEN:
        raise ValueError(f"{flag} must be in 1..{MAX_DRAFT_LEN} (tokens drafted per step), got {K}")


def _check_drafter_args(args: argparse.Namespace) -> None:
    """--k in range, and --drafter-path only for a drafter that loads one (before any model is loaded)."""
    from hspec.drafters.spec import MODEL_FREE, parse_drafter_spec

    _check_draft_len(args.k)
    if args.drafter_path is not None and parse_drafter_spec(args.drafter).base in MODEL_FREE:
        raise ValueError(f"--drafter-path {args.drafter_path} was given, but --drafter {args.drafter} loads no "
                         f"checkpoint ({', '.join(MODEL_FREE)} are model-free); drop --drafter-path or name a "
                         "trained kind, e.g. --drafter hspec")


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder of the evaluation sets and training prompts (spec_bench.jsonl, ..., "
                        "train_prompts.jsonl[.gz]) instead of the copy shipped in hspec/data "
                        "(default: $HSPEC_DATA_DIR if set, else the shipped copy)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Each `_add_*` below builds one subcommand's parser and names, with
    `set_defaults(handler=...)`, the `_cmd_*` function `main` calls for it."""
    parser = argparse.ArgumentParser(
        prog="hspec", description="Lossless speculative decoding with the H-Spec drafter and its baselines.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_demo, _add_data, _add_train, _add_eval, _add_export_drafter, _add_export_gguf,
                _add_eval_report,
                _add_eval_merge, _add_claims, _add_eval_table, _add_train_report, _add_validate, _add_bench,
                _add_serve, _add_kv_table, _add_drafters):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand `argv` names (default: the process's arguments); a bad value exits with 2."""
    args = build_parser().parse_args(argv)
    args.command_line = "hspec " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "json", None) is True:  # `--json`: stdout carries the JSON alone (`eval-report`'s is a path)
            with json_stdout() as args.json_out:
                return args.handler(args)
        return args.handler(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # FileExistsError: an output that is not ours
        print(f"hspec: error: {err}", file=sys.stderr)
        return 2


def _ints(text: str) -> list[int]:
    """'1,16' -> [1, 16]; raises ValueError naming the bad list."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, with metrics",
                         description="Generate with speculative decoding; output equals the target's own.")
    gen.add_argument("--prompt", required=True, help="user message (wrapped in the chat template)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, no chat template")
    _add_target(gen)
    _add_dtype(gen)
    _add_drafter(gen, "ngram")
    _add_compile_drafter(gen)
    _add_drafter_precision(gen)
    _add_decoding_options(gen)
    _add_step_cost(gen)
    _add_sampling(gen)
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", default=[], help="stop string, non-empty (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(handler=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    """Generate text for one prompt with a drafter and print it with its metrics."""
    import torch

    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter, decoding_options_of
    from hspec.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)  # validate before loading
    _check_drafter_args(args)
    options = decoding_options_of([args.drafter], args.drafter_option)[args.drafter]
    step_cost = _step_cost(args.step_cost)
    if "" in args.stop:  # an empty string is found at once: the text would be cut to nothing
        raise ValueError(f"--stop needs a non-empty string, got {args.stop!r}")
    target = load_target(args.target, dtype=args.dtype)
    drafter = build_drafter(args.drafter, target, args.drafter_path, compiled=args.compile_drafter,
                            precision=args.drafter_precision, options=options, K=args.k, step_cost=step_cost)
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
    print(f"\n[{args.drafter}, K={metrics['K']}] {metrics['num_tokens']} tokens, finish={seq.finish_reason}, "
          f"MAL {metrics['mean_accepted_length']:.2f}, {metrics['decode_tokens_per_s']:.1f} tok/s decoding "
          f"(prefill {metrics['prefill_s']:.2f} s), "
          f"ITL {metrics['itl_ms']:.1f} ms, draft {metrics['draft_ms_per_step']:.1f} ms/step, "
          f"verify {metrics['verify_ms_per_step']:.1f} ms/step")
    if metrics["acceptance_by_position"]:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in metrics["acceptance_by_position"])
        print(f"acceptance by position: {acc}")


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="the README's main job: drafters vs plain decoding on a few prompts",
                          description="Runs plain decoding and each drafter on a few prompts, interleaved, "
                                      "checks that outputs match, and prints text, MAL, tokens/s, speedup.")
    _add_target(demo)
    _add_dtype(demo, default="fastest")
    demo.add_argument("--drafters", default="ngram,ngram:auto,hspec,hspec:auto,hspec+ngram:0.4,hspec+ngram:auto",
                      help="comma-separated drafter kinds (default ngram,ngram:auto,hspec,hspec:auto,hspec+ngram:0.4,"
                           "hspec+ngram:auto): n-gram and the shipped H-Spec drafter verifying all K drafts, and with "
                           "the draft length chosen per row and step by this machine's costs (:auto; 0 = a plain "
                           "decode step; the costs are measured once, ~10 s, and cached), and H-Spec behind prompt "
                           "lookup verifying only the drafts it is >= 0.4 sure of, or with :auto")
    demo.add_argument("--k", type=int, default=7)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the README's demo: drafters against plain decoding on a few prompts."""
    from hspec.demo import run_demo

    _check_draft_len(args.k)
    return run_demo(args.target, [k for k in args.drafters.split(",") if k], args.k,
                    args.max_new_tokens, list(DEMO_PROMPTS), dtype=args.dtype)


def _add_data(sub) -> None:
    """`hspec data generate` and `hspec data features`."""
    data = sub.add_parser("data", help="training data: the target's own responses")
    data_sub = data.add_subparsers(dest="data", required=True)
    dgen = data_sub.add_parser("generate", help="generate the target's responses to training prompts (resumable)",
                               description="Batched greedy (or sampled) responses of the target to the training "
                                           "prompts, appended to a JSONL file; rerun the same command to resume.")
    _add_target(dgen)
    dgen.add_argument("--prompts", default="train_prompts.jsonl",
                      help="prompt JSONL (normalized format): a path, or a file (or its .gz) in the data folder "
                           "(default train_prompts.jsonl: the shipped training prompts)")
    _add_data_dir(dgen)
    dgen.add_argument("--num-prompts", type=int, default=None, help="how many prompts (default all)")
    dgen.add_argument("--skip-prompts", type=int, default=0,
                      help="start this far into the shuffled prompt order, so corpus parts made by separate "
                           "(parallel) runs never overlap (default 0)")
    dgen.add_argument("--max-prompt-tokens", type=int, default=384)
    dgen.add_argument("--max-new-tokens", type=int, default=256)
    dgen.add_argument("--batch-size", type=int, default=16)
    _add_sampling(dgen)
    _add_device(dgen, default="cpu")
    dgen.add_argument("--out", default="runs/data/smollm2_responses.jsonl", help="output JSONL")
    dgen.set_defaults(handler=_cmd_data_generate)
    dfeat = data_sub.add_parser("features", help="cache the target features all drafters train from (resumable)",
                                description="Run the target once over every generated sequence and cache the "
                                            "selected layers' hidden states, their K/V and the final hidden state.")
    _add_target(dfeat)
    dfeat.add_argument("--corpus", default="runs/data/smollm2_responses.jsonl", help="output of `data generate`")
    dfeat.add_argument("--out", default="runs/features/smollm2", help="feature cache directory")
    dfeat.add_argument("--max-sequences", type=int, default=None)
    _add_device(dfeat, default="cpu")
    dfeat.set_defaults(handler=_cmd_data_features)


def _cmd_data_generate(args: argparse.Namespace) -> int:
    """Generate the target's responses to the training prompts (resumable)."""
    from pathlib import Path

    from hspec.training.datagen import DataGenSettings, generate_corpus

    settings = DataGenSettings(
        target=args.target, prompts_file=args.prompts, num_prompts=args.num_prompts,
        skip_prompts=args.skip_prompts, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, batch_size=args.batch_size, shuffle_seed=args.seed, device=args.device,
        data_dir=args.data_dir)
    print(f"wrote {generate_corpus(settings, Path(args.out))}")
    return 0


def _cmd_data_features(args: argparse.Namespace) -> int:
    """Cache the target features every drafter trains from (resumable)."""
    from pathlib import Path

    from hspec.training.run import build_features

    cache = build_features(args.target, Path(args.corpus), Path(args.out), args.max_sequences, args.device)
    print(f"wrote {cache}")
    return 0


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train a drafter with the unified recipe (resumable; torchrun for DDP)",
                           description="0.1 CE + 0.9 TV with position weights exp(-(k-1)/4), AdamW, 1% warmup "
                                       "then half-cosine. Rerun the same command to resume after a kill.")
    _add_target(train)
    train.add_argument("--drafter", required=True, help="drafter kind to train (see `hspec drafters describe`)")
    source = train.add_mutually_exclusive_group()
    source.add_argument("--features", default="runs/features/smollm2",
                        help="feature cache dir(s) from `data features`, comma-separated")
    source.add_argument("--corpus", default=None,
                        help="instead of --features: generated corpus JSONL file(s) from `data generate`, "
                             "comma-separated; the target computes each sequence's features when a step needs "
                             "them (no cache; best on a GPU)")
    train.add_argument("--out", default=None, help="run directory (default runs/train/<kind>)")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--seqs-per-step", type=int, default=4)
    train.add_argument("--anchors-per-seq", type=int, default=16)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--val-every", type=int, default=100,
                       help="validate (and save the training state) every this many steps (default 100)")
    train.add_argument("--save-minutes", type=float, default=10.0,
                       help="also save the training state once this many minutes have passed since the last "
                            "save, so a machine lost without a signal costs at most that much (default 10)")
    train.add_argument("--draft-vocab", type=int, default=None,
                       help="pruned draft vocabulary size Vp: the most frequent training tokens (default: the "
                            "paper's 32,000, or the whole vocabulary if smaller)")
    train.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                       help="start from this saved drafter of the same kind (e.g. RUN/drafter of an earlier run) "
                            "to train it on more data; keeps its config and draft vocabulary, restarts the "
                            "schedule (warmup + half-cosine over --steps). For --drafter dels, a trained dflash "
                            "drafter: DeLS-Spec trains its local head over it, frozen")
    train.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                       help="set a field of a fresh drafter's config (repeatable), e.g. "
                            "selector_trains_backbone=false for dflash2; an unknown key lists the ones the kind "
                            "has (not with --init-from, which keeps the saved config)")
    train.add_argument("--override", action="store_true",
                       help="resume a run dir although settings changed (e.g. another --steps or --lr): without "
                            "it such a rerun stops and lists the changes; with it the change is recorded in the "
                            "run's history.jsonl and the new settings apply from the resumed step")
    train.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16-autocast"),
                       help="arithmetic of the drafter's forward and backward: fp32, or bf16 autocast over fp32 "
                            "master weights, optimizer state and loss. auto: bf16-autocast on CUDA and on a CPU "
                            "with native bf16 dot products (AVX512-BF16/AMX), else fp32 (measured: "
                            "results/train_precision_cpu.md); a resumed run keeps the precision it recorded "
                            "(default auto)")
    _add_device(train)
    train.set_defaults(handler=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    """Train (or resume training) a drafter with the unified recipe."""
    from pathlib import Path

    from hspec.drafters import DRAFTERS
    from hspec.drafters.base import parse_config_options
    from hspec.training.run import train as run_training
    from hspec.training.trainer import TrainConfig

    config = TrainConfig(steps=args.steps, lr=args.lr, seqs_per_step=args.seqs_per_step,
                         anchors_per_seq=args.anchors_per_seq, seed=args.seed,
                         cod_keep=DRAFTERS.get(args.drafter).trains_with_cod, precision=args.precision)
    out = Path(args.out or f"runs/train/{args.drafter}")
    saved = run_training(args.drafter, args.target, [Path(p) for p in args.features.split(",")], out,
                         config, val_every=args.val_every, draft_vocab_size=args.draft_vocab,
                         init_from=None if args.init_from is None else Path(args.init_from),
                         corpora=None if args.corpus is None else [Path(p) for p in args.corpus.split(",")],
                         device=args.device, override=args.override, save_minutes=args.save_minutes,
                         drafter_options=parse_config_options(args.drafter, args.drafter_option))
    print(f"wrote {saved}")
    return 0


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="drafters vs plain decoding on the task suites (tau, speedup, CIs)",
                        description="Runs plain decoding and each drafter item by item (interleaved) on fixed "
                                    "subsets of the task suites; writes JSON + markdown under --out. Finished "
                                    "items are kept in OUT/NAME.partial.jsonl until the report is written, so "
                                    "the same command run again after a kill resumes where it stopped.")
    _add_target(ev)
    _add_dtype(ev)
    ev.add_argument("--drafters", default="ngram,hspec",
                    help="comma-separated kinds, optionally KIND=CHECKPOINT_DIR (plain decoding always runs)")
    ev.add_argument("--tasks", default="spec_bench", help="comma-separated task names (see hspec.data.tasks)")
    ev.add_argument("--size", type=int, default=24, help="items per task (evenly spaced, fixed; default 24)")
    ev.add_argument("--k", default="7",
                    help="draft length K, or several comma-separated (e.g. 3,5,7: the draft-length sensitivity; "
                         "each drafter runs once per K, interleaved) (default 7)")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    _add_compile_drafter(ev)
    _add_drafter_precision(ev)
    _add_decoding_options(ev)
    _add_step_cost(ev)
    _add_sampling(ev)
    ev.add_argument("--out", default="results", help="output directory")
    ev.add_argument("--name", default=None, help="file stem (default eval_<tasks>_k<K>_<greedy|sampled>)")
    ev.add_argument("--keep-current", action="store_true",
                    help="where OUT/NAME.json was made with these settings and the same checkpoints (by the "
                         "digest of their weights, which the report records), keep it and decode nothing")
    _add_data_dir(ev)
    ev.set_defaults(handler=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate drafters against plain decoding on the task suites."""
    from pathlib import Path

    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.runtime import decoding_options_of
    from hspec.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    methods = [MethodSpec(*spec.split("=", 1)) if "=" in spec else MethodSpec(spec)
               for spec in args.drafters.split(",") if spec]
    options = decoding_options_of([m.kind for m in methods], args.drafter_option)
    step_cost = _step_cost(args.step_cost)
    mode = "greedy" if sampling.greedy else "sampled"
    ks = _ints(args.k)
    for k in ks:
        _check_draft_len(k)
    stem = args.name or f"eval_{args.tasks.replace(',', '+')}_k{'+'.join(map(str, ks))}_{mode}"
    run_eval(args.target, methods, args.tasks.split(","), args.size, ks if len(ks) > 1 else ks[0], sampling,
             args.max_new_tokens, Path(args.out), stem, args.seed, args.command_line, data_dir=args.data_dir,
             dtype=args.dtype, compile_drafters=args.compile_drafter, drafter_precision=args.drafter_precision,
             keep_current=args.keep_current, drafter_options=options, step_cost=step_cost)
    print(f"report: {Path(args.out) / stem}.json and .md")
    return 0


def _add_export_drafter(sub) -> None:
    exp = sub.add_parser("export-drafter", help="copy a drafter checkpoint with weights stored in bf16/fp16",
                         description="Ship a trained drafter smaller: floating weights are cast to --dtype "
                                     "(loading casts them back); the draft vocabulary ids stay exact.")
    exp.add_argument("src", help="checkpoint directory (config.json + model.safetensors)")
    exp.add_argument("dst", help="output directory")
    exp.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    exp.set_defaults(handler=_cmd_export_drafter)


def _cmd_export_drafter(args: argparse.Namespace) -> int:
    """Copy a drafter checkpoint with its weights stored in a smaller dtype."""
    import torch

    from hspec.drafters.checkpoint import export_drafter

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"wrote {export_drafter(args.src, args.dst, dtype)}")
    return 0


def _add_export_gguf(sub) -> None:
    exp = sub.add_parser("export-gguf", help="a dflash/dspark drafter as the GGUF llama.cpp drafts with",
                         description="Write an hspec DFlash or DSpark checkpoint as llama.cpp's drafter GGUF (its "
                                     "`dflash` architecture) and print the llama-cli line that runs it "
                                     "(--spec-type draft-dspark: the block layout hspec trains; docs/llama-cpp.md).")
    exp.add_argument("src", help="drafter checkpoint directory (config.json + model.safetensors)")
    exp.add_argument("dst", help="output .gguf file")
    exp.add_argument("--target", default=None, metavar="GGUF",
                     help="the target's GGUF as llama.cpp runs it (default: the embedded SmolLM2 GGUF)")
    exp.add_argument("--dtype", choices=("f16", "f32"), default="f16",
                     help="matrices' storage type (norms stay f32; default f16)")
    exp.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                     help="target id whose embedding row carries the learned MASK embedding (default: the last "
                          "special token that is neither BOS nor EOS)")
    exp.set_defaults(handler=_cmd_export_gguf)


def _cmd_export_gguf(args: argparse.Namespace) -> int:
    """Export a drafter to llama.cpp's GGUF and print how to run it."""
    from pathlib import Path

    from hspec.integrations.llama_cpp.export import export_gguf
    from hspec.models.loading import default_gguf_path, resolve_target_dir

    target = Path(args.target).expanduser() if args.target else default_gguf_path()
    if target.suffix != ".gguf" or not target.is_file():
        raise ValueError(f"--target must be the target's .gguf file (llama.cpp runs GGUFs), got {target}")
    _, target_dir = resolve_target_dir(str(target))
    out = export_gguf(args.src, args.dst, target, target_dir, dtype=args.dtype, mask_token_id=args.mask_token_id)
    print(f"wrote {out.path} ({out.kind}, K = {out.block_size}, Vp = {out.draft_vocab_size}, "
          f"MASK = id {out.mask_token_id})")
    print("run it: llama-cli " + " ".join(out.llama_cli_args(target)))
    return 0


def _add_eval_report(sub) -> None:
    erep = sub.add_parser("eval-report", help="re-render an eval run's markdown and plots from its JSON",
                          description="Recompute the summary (per task and category, CIs) and the plots from the "
                                      "records saved in an `hspec eval` JSON file; nothing is re-run.")
    erep.add_argument("json", help="results/eval_*.json written by `hspec eval`")
    erep.set_defaults(handler=_cmd_eval_report)


def _cmd_eval_report(args: argparse.Namespace) -> int:
    """Re-render an eval run's markdown and plots from its JSON."""
    from pathlib import Path

    from hspec.eval.runner import summarize, write_report

    path = Path(args.json)
    payload = json.loads(path.read_text())
    labels = list(dict.fromkeys(r["method"] for r in payload["records"]))
    k_setting = payload["provenance"]["settings"]["K"]
    payload["summary"] = summarize(payload["records"], labels, k_setting if isinstance(k_setting, int)
                                   else k_setting[0])
    payload["provenance"]["report_command"] = f"hspec eval-report {path}"
    write_report(payload, path.parent, path.stem)
    print(f"wrote {path.with_suffix('.md')} and plots")
    return 0


def _add_eval_merge(sub) -> None:
    merge = sub.add_parser("eval-merge", help="one evaluation from shards evaluated apart (scripts/compare_long.sh)",
                           description="Merges, file stem by file stem, the `hspec eval` JSONs of shard directories "
                                       "(the same evaluation run for different drafters, possibly on other machines) "
                                       "into OUT, as one run would have written them. Shards must share every "
                                       "setting but their drafters; each drafter's speedup stays over its own "
                                       "shard's plain decoding, and drafters are paired only on turns where their "
                                       "shards' plain outputs agree (docs/claims.md#shards).")
    merge.add_argument("shards", nargs="+", help="shard directories, each holding eval JSONs; merged in the order "
                                                 "they were evaluated, the first one's plain decoding kept")
    merge.add_argument("--out", required=True, help="output directory of the merged JSONs, markdown and plots")
    merge.set_defaults(handler=_cmd_eval_merge)


def _cmd_eval_merge(args: argparse.Namespace) -> int:
    """Merge shard evaluations into one per file stem."""
    from pathlib import Path

    from hspec.eval.merge import merge_shards

    for path in merge_shards([Path(d) for d in args.shards], Path(args.out), args.command_line):
        print(f"wrote {path} and its markdown")
    return 0


def _add_claims(sub) -> None:
    claims = sub.add_parser("claims", help="the paper's claims tested on a comparison's eval JSONs (docs/claims.md)",
                            description="Reads the `hspec eval` JSONs of a results folder (as scripts/compare_long.sh "
                                        "names them) and, per claim of the H-Spec paper (Tables 2-4, Fig. 4, Fig. 7, "
                                        "the Markov head), gives paired bootstrap 95% CIs over items and a verdict: "
                                        "reproduced (in part, while a pair it names is in no file), contradicted or "
                                        "unresolved; a claim whose file or drafter is "
                                        "missing is skipped, saying why. Writes claims.json and claims.md.")
    claims.add_argument("folder", help="results folder holding the eval JSONs, e.g. results/comparison_long")
    claims.add_argument("--out", default=None, help="output directory (default: the folder itself)")
    claims.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default 0)")
    claims.set_defaults(handler=_cmd_claims)


def _cmd_claims(args: argparse.Namespace) -> int:
    """Test the paper's claims on a folder's eval JSONs; print each verdict, write claims.json and .md."""
    from pathlib import Path

    from hspec.eval.claims import write_claims

    json_path, md_path = write_claims(Path(args.folder), None if args.out is None else Path(args.out),
                                      args.command_line, seed=args.seed)
    for claim in json.loads(json_path.read_text())["claims"]:
        print(f"{claim['name']} ({claim['source']}): {claim['verdict']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


def _add_eval_table(sub) -> None:
    table = sub.add_parser("eval-table", help="every drafter of a comparison folder on one row, across its evaluations",
                           description="Reads the eval JSONs of a results folder (the files `hspec claims` reads) and "
                                       "the training histories its shards kept (shards/*/runs/*/history.jsonl), and "
                                       "writes eval_table.json and eval_table.md: per drafter kind its shard, its "
                                       "training time, its last validation tau and, per evaluation, its tau and "
                                       "speedup over plain decoding as that evaluation states them. The folder's "
                                       "README.md quotes this table.")
    table.add_argument("folder", help="results folder, e.g. results/comparison_long")
    table.add_argument("--out", default=None, help="output directory (default: the folder itself)")
    table.set_defaults(handler=_cmd_eval_table)


def _cmd_eval_table(args: argparse.Namespace) -> int:
    """Write one table of every drafter across a folder's evaluations."""
    from pathlib import Path

    from hspec.eval.table import write_table

    json_path, md_path = write_table(Path(args.folder), None if args.out is None else Path(args.out),
                                     args.command_line)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _add_train_report(sub) -> None:
    rep = sub.add_parser("train-report", help="loss curves + validation acceptance of training runs (markdown + PNG)")
    rep.add_argument("runs", nargs="+", help="run directories of `hspec train`")
    rep.add_argument("--out", default="results/train_report.md")
    rep.add_argument("--title", default="Drafter training")
    rep.set_defaults(handler=_cmd_train_report)


def _cmd_train_report(args: argparse.Namespace) -> int:
    """Write loss curves and validation acceptance of training runs."""
    from pathlib import Path

    from hspec.training.report import write_training_report

    print(f"wrote {write_training_report([Path(r) for r in args.runs], Path(args.out), args.title)}")
    return 0


def _add_validate(sub) -> None:
    val = sub.add_parser("validate", help="validation tau of saved drafters on the held-out training split",
                         description="Greedy teacher-forced acceptance of each drafter on the held-out sequences "
                                     "`hspec train` validates on: over uniformly drawn anchors and in decode order "
                                     "(the anchors greedy decoding visits). Writes JSON + markdown.")
    _add_target(val)
    val.add_argument("drafters", nargs="+", help="drafter directories (RUN/drafter or an exported drafter)")
    val.add_argument("--features", default="runs/features/smollm2",
                     help="feature cache dir(s) from `data features`, comma-separated (as given to `hspec train`)")
    val.add_argument("--val-sequences", type=int, default=24, help="held-out sequences to use (default 24)")
    val.add_argument("--out", default="results", help="output directory (default results)")
    val.add_argument("--name", default="validation", help="file stem (default validation)")
    val.set_defaults(handler=_cmd_validate)


def _cmd_validate(args: argparse.Namespace) -> int:
    """Measure validation tau of saved drafters on the held-out training split."""
    from pathlib import Path

    from hspec.training.run import validate_drafters

    _, md = validate_drafters(args.target, [Path(f) for f in args.features.split(",")],
                              [Path(d) for d in args.drafters], Path(args.out), args.val_sequences, args.name)
    print(f"wrote {md}")
    return 0


def _add_bench(sub) -> None:
    """`hspec bench decode|serve|vllm|vllm-serve|draft`."""
    bench = sub.add_parser("bench", help="benchmarks that write results/*.json and *.md")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for add in (_add_bench_decode, _add_bench_serve, _add_bench_vllm, _add_bench_vllm_serve, _add_bench_draft):
        add(bench_sub)


def _add_bench_decode(bench_sub) -> None:
    bdec = bench_sub.add_parser("decode", help="plain decode per dtype vs transformers; verify cost vs K",
                                description="Interleaved plain-decode ms/token of this runtime in each --dtypes "
                                            "entry, of its float32 runtime before stacked projections, of "
                                            "transformers' eager generate and of llama.cpp when installed; the cost "
                                            "of a (K+1)-token verify over a 1-token decode per dtype; the prefill "
                                            "time of --prefill-tokens prompts in every runtime. Writes "
                                            "<out>/decode_cpu.{json,md}.")
    _add_target(bdec)
    bdec.add_argument("--dtypes", default="float32,bfloat16,int8,int4",
                      help="comma-separated dtypes to time (auto, float32, bfloat16, int8, int4, w4a8; default "
                           "float32,bfloat16,int8,int4)")
    bdec.add_argument("--no-transformers", action="store_true", help="leave out the transformers column")
    bdec.add_argument("--max-prompt-tokens", type=int, default=128,
                      help="keep each decoded prompt's first N tokens (its prefill is not timed; default 128)")
    bdec.add_argument("--prefill-tokens", default="128,512",
                      help="prompt lengths whose prefill is timed in every runtime (the Spec-Bench prompts run "
                           "together and cut to length; default 128,512)")
    bdec.add_argument("--num-prompts", type=int, default=2, help="Spec-Bench prompts (default 2)")
    bdec.add_argument("--max-new-tokens", type=int, default=32,
                      help="tokens per prompt and runtime, >= 2; the first comes from the untimed prefill (default 32)")
    bdec.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    bdec.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (default 1: on a shared 2-core host, 2 threads stall on each other's "
                           "neighbours; 0 = torch's default)")
    bdec.add_argument("--out", default="results", help="output directory")
    _add_data_dir(bdec)
    bdec.set_defaults(handler=_cmd_bench_decode)


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    """Benchmark plain decoding per dtype and the verify cost against K."""
    from hspec.bench.decode import run_decode_bench

    return run_decode_bench(args.target, args.num_prompts, args.max_new_tokens, args.repeats, args.out,
                            data_dir=args.data_dir, dtypes=[d for d in args.dtypes.split(",") if d],
                            transformers=not args.no_transformers, max_prompt_tokens=args.max_prompt_tokens,
                            threads=args.threads, prefill_tokens=_ints(args.prefill_tokens))


def _add_bench_serve(bench_sub) -> None:
    bserve = bench_sub.add_parser(
        "serve", help="closed-loop serving throughput and KV utilisation vs concurrency (paper Fig. 6)",
        description="Starts one `hspec serve` per drafter kind on 127.0.0.1 with the same KV memory budget, "
                    "then for each concurrency level runs C closed-loop HTTP clients (greedy chat requests "
                    "over eval-set prompts) against each server in turn for --level-seconds. Writes "
                    "<out>/serving/serve_bench.{json,md}, throughput_vs_concurrency.png, "
                    "kv_vs_concurrency.png and the KV capacity in tokens per drafter kind at the budget.")
    _add_target(bserve)
    _add_dtype(bserve)
    bserve.add_argument("--drafters", default="none,ngram",
                        help="comma-separated kinds to serve (default none,ngram; none = plain decoding)")
    bserve.add_argument("--concurrency", default="8,16,32,64,128", help="comma-separated client counts")
    bserve.add_argument("--k", type=int, default=7, help="tokens drafted per step (default 7)")
    bserve.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    bserve.add_argument("--level-seconds", type=float, default=60.0,
                        help="time bound per level and kind: no new requests after it (default 60)")
    bserve.add_argument("--tasks", default="spec_bench", help="comma-separated prompt sets (default spec_bench)")
    bserve.add_argument("--num-prompts", type=int, default=240, help="items per task (default 240)")
    bserve.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (default 256)")
    bserve.add_argument("--server-threads", type=int, default=0,
                        help="torch threads of each server (default 0 = torch's default)")
    bserve.add_argument("--drafter-path", action="append", default=[], metavar="KIND=DIR",
                        help="trained checkpoint for a kind (repeatable); default: the one shipped for the target")
    bserve.add_argument("--random-drafter-weights", action="store_true",
                        help="serve trained kinds untrained where no checkpoint exists (timing / KV only)")
    _add_pool_options(bserve, default_budget_mib=256.0)
    bserve.add_argument("--spec-max-batch", default="none", metavar="LIST",
                        help="comma-separated `hspec serve --spec-max-batch` values, `none` = always speculate; "
                             "each drafting kind is served once per value, beside the others (default none)")
    bserve.add_argument("--name", default="serve_bench",
                        help="stem of the result files (default serve_bench; other names prefix the plots too)")
    bserve.add_argument("--out", default="results", help="output directory; files go to <out>/serving/")
    _add_data_dir(bserve)
    bserve.set_defaults(handler=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    """Benchmark the server under load: throughput, latency and KV use."""
    from hspec.bench.serve import ServeBenchSettings, run_serve_bench

    _check_draft_len(args.k)
    settings = ServeBenchSettings(
        target=args.target, dtype=args.dtype, drafters=tuple(k for k in args.drafters.split(",") if k),
        concurrency=_concurrency(args.concurrency), K=args.k, max_tokens=args.max_tokens,
        level_seconds=args.level_seconds, tasks=tuple(t for t in args.tasks.split(",") if t),
        num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens, kv_budget_mib=args.kv_budget_mib,
        block_size=args.block_size, max_running=args.max_running,
        speculate_max_batch=_spec_limits(args.spec_max_batch), server_threads=args.server_threads, out=args.out,
        name=args.name,
        random_drafter_weights=args.random_drafter_weights,
        drafter_paths=tuple(_kind_path(x) for x in args.drafter_path), data_dir=args.data_dir)
    return run_serve_bench(settings, args.command_line)


def _spec_limits(text: str) -> tuple[int | None, ...]:
    """'none,2' -> (None, 2); raises ValueError naming --spec-max-batch."""
    try:
        return tuple(None if x.strip() == "none" else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--spec-max-batch must be comma-separated integers >= 0 or `none`, got {text!r}") from None


def _concurrency(text: str) -> tuple[int, ...]:
    """'8,16' -> (8, 16); raises ValueError naming --concurrency."""
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError as err:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from err


def _kind_path(text: str) -> tuple[str, str]:
    """'KIND=DIR' -> (KIND, DIR); raises ValueError naming --drafter-path."""
    kind, sep, path = text.partition("=")
    if not sep or not kind or not path:
        raise ValueError(f"--drafter-path must look like KIND=DIR, got {text!r}")
    return kind, path


def _add_bench_vllm(bench_sub) -> None:
    bv = bench_sub.add_parser(
        "vllm", help="drafters inside vLLM (CPU build): greedy equality with vLLM plain, tau, tok/s, KV capacity",
        description="Batch-1 greedy decoding of the target in vLLM with each drafter, interleaved prompt by prompt, "
                    "plus hspec's own engine on the same token ids. Needs vLLM: `bash scripts/install_vllm.sh` "
                    "(docs/vllm.md). Without --json writes results/vllm/vllm_<dtype>.json and .md with provenance.")
    _add_target(bv)
    bv.add_argument("--drafters", default="none,ngram,dflash=random",
                    help="comma-separated: none (vLLM plain, always run), ngram, suffix (vLLM's suffix decoding; "
                         "needs arctic-inference==0.1.1, a source build), dflash=PATH (an hspec DFlash "
                         "checkpoint, exported for vLLM on the fly, or such an export), dflash=random (seed-0 random "
                         "weights: losslessness and KV cost, not tau), peagle=PATH or peagle=random (hspec's P-Eagle "
                         "as vLLM's parallel EAGLE-3), hspec (the shipped H-Spec drafter as a vLLM "
                         "proposer) or hspec=PATH (an hspec H-Spec checkpoint); hspec:P keeps each request's drafts "
                         "of confidence >= P, hspec@B drafts at most B tokens per step over the batch (both combine: "
                         "hspec:0.4@64=PATH); default none,ngram,dflash=random")
    bv.add_argument("--prompts-file", default=None, metavar="F.jsonl",
                    help='one {"prompt": "..."} per line, chat-templated like `hspec generate` '
                         "(default: --num-prompts evenly spaced Spec-Bench items)")
    bv.add_argument("--num-prompts", type=int, default=4, help="prompts to use (default 4; 0 = the whole file)")
    bv.add_argument("--max-new-tokens", type=int, default=64)
    bv.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="vLLM's compute dtype; greedy equality is exact only in float32 (default)")
    bv.add_argument("--k", type=int, default=5,
                    help="drafts per step for ngram (default 5; DFlash: its export's; H-Spec: its checkpoint's "
                         "trained draft length)")
    bv.add_argument("--max-model-len", type=int, default=1024, help="vLLM's max_model_len (default 1024)")
    bv.add_argument("--no-hspec-engine", action="store_true", help="skip the rows of hspec's own engine")
    bv.add_argument("--hspec-dtype", choices=("float32", "bfloat16", "int8", "int4", "w4a8"), default="float32",
                    help="dtype of hspec's own engine (default float32, where its tau and outputs are compared "
                         "exactly with vLLM's float32 run; bfloat16, int8, int4 or w4a8 to race vLLM)")
    bv.add_argument("--hspec-methods", default="",
                    help="comma-separated hspec drafters run only in hspec's engine, e.g. hspec+ngram:0.4 "
                         "(none already runs)")
    bv.add_argument("--hspec-k", type=int, default=7, help="K of the --hspec-methods rows (default 7)")
    bv.add_argument("--threads", type=int, default=2,
                    help="CPU threads of every vLLM engine and of hspec's engine alike (default 2)")
    bv.add_argument("--name", default=None, help="file stem of the results (default vllm_<dtype>)")
    bv.add_argument("--json", action="store_true",
                    help="print the rows as JSON on stdout, vLLM's logs on stderr, instead of writing results/vllm/")
    bv.add_argument("--out", default="results/vllm", help="output directory (default results/vllm)")
    _add_data_dir(bv)
    bv.set_defaults(handler=_cmd_bench_vllm)


def _cmd_bench_vllm(args: argparse.Namespace) -> int:
    """Benchmark drafters inside vLLM: greedy equality with vLLM plain decoding, tau, tok/s, KV capacity."""
    from hspec.bench.vllm import HspecSide, run_vllm_bench

    _check_draft_len(args.hspec_k, "--hspec-k")
    hspec = HspecSide(args.hspec_dtype, tuple(m for m in args.hspec_methods.split(",") if m), args.hspec_k)
    return run_vllm_bench(args.target, args.drafters, args.prompts_file, args.num_prompts,
                          args.max_new_tokens, args.dtype, args.k, args.max_model_len, args.out,
                          args.json_out if args.json else None,
                          data_dir=args.data_dir, hspec_engine=not args.no_hspec_engine, hspec=hspec, name=args.name,
                          threads=args.threads)


def _add_bench_vllm_serve(bench_sub) -> None:
    bvs = bench_sub.add_parser(
        "vllm-serve", help="serving throughput vs concurrency through vLLM's OpenAI server, and hspec serve",
        description="Starts vLLM's OpenAI server once per --drafters configuration (then `hspec serve` with the "
                    "matching drafter), sends the same --num-requests greedy chat requests at each --concurrency, "
                    "and records output tok/s, latency and TTFT p50/p90, KV use and capacity, tau, and outputs "
                    "equal to vLLM plain at batch 1. Writes <out>/serve_<dtype>.{json,md} and "
                    "serve_<dtype>_throughput.png. Needs vLLM (docs/vllm.md).")
    _add_target(bvs)
    bvs.add_argument("--drafters", default="none,ngram,hspec",
                     help="as `hspec bench vllm --drafters`: none (always run), ngram, suffix, dflash=PATH, "
                          "dflash=random, peagle=PATH, peagle=random, hspec, hspec=PATH, hspec:P, hspec@B (at most B "
                          "drafts per step over the batch) (default none,ngram,hspec)")
    bvs.add_argument("--concurrency", default="8,16,32,64", help="comma-separated levels (default 8,16,32,64)")
    bvs.add_argument("--num-requests", type=int, default=64, help="requests per level (default 64)")
    bvs.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    bvs.add_argument("--prompts-file", default=None, metavar="F.jsonl",
                     help='one {"prompt": "..."} per line (default: evenly spaced Spec-Bench items)')
    bvs.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="compute dtype of every server (default float32, where outputs must equal batch 1)")
    bvs.add_argument("--k", type=int, default=5, help="drafts per step for ngram (default 5)")
    bvs.add_argument("--max-model-len", type=int, default=2048,
                     help="vLLM's max_model_len; prompt + --max-tokens must fit (default 2048)")
    bvs.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of every server in GiB (default 1)")
    bvs.add_argument("--threads", type=int, default=2,
                     help="OpenMP/torch threads per server; servers run one at a time (default 2)")
    bvs.add_argument("--no-hspec-engine", action="store_true", help="skip the `hspec serve` rows")
    bvs.add_argument("--out", default="results/vllm", help="output directory (default results/vllm)")
    bvs.add_argument("--name", default=None, help="file stem of the results (default serve_<dtype>)")
    _add_data_dir(bvs)
    bvs.set_defaults(handler=_cmd_bench_vllm_serve)


def _cmd_bench_vllm_serve(args: argparse.Namespace) -> int:
    """Benchmark serving throughput, latency and KV use vs concurrency through vLLM's OpenAI server."""
    from hspec.bench.vllm_serve import VllmServeSettings, run_vllm_serve_bench

    settings = VllmServeSettings(
        target=args.target, drafters=args.drafters, concurrency=tuple(_ints(args.concurrency)),
        num_requests=args.num_requests, max_tokens=args.max_tokens, dtype=args.dtype, k=args.k,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
        prompts_file=args.prompts_file, hspec_engine=not args.no_hspec_engine, out=args.out, name=args.name,
        data_dir=args.data_dir)
    return run_vllm_serve_bench(settings, args.command_line)


def _add_bench_draft(bench_sub) -> None:
    bdraft = bench_sub.add_parser("draft", help="draft forward cost T_D(K) / verify cost T_T per drafter kind",
                                  description="Interleaved timing of one propose(K=7) per kind against the "
                                              "target's 8-token verify, for several batch sizes and contexts "
                                              "(random drafter weights); writes results/draft_cost_<device>.*")
    _add_target(bdraft)
    _add_dtype(bdraft)
    bdraft.add_argument("--drafters", default="", help="comma-separated kinds (default: every registered kind)")
    bdraft.add_argument("--batch-sizes", default="1,16", help="comma-separated B (default 1,16)")
    bdraft.add_argument("--contexts", default="256,2048", help="comma-separated context lengths (default 256,2048)")
    bdraft.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    bdraft.add_argument("--draft-vocab", type=int, default=None,
                        help="pruned draft vocabulary Vp of every trained kind (default: the paper's 32,000)")
    _add_compile_drafter(bdraft)
    _add_drafter_precision(bdraft)
    bdraft.add_argument("--out", default="results", help="output directory")
    bdraft.set_defaults(handler=_cmd_bench_draft)


def _cmd_bench_draft(args: argparse.Namespace) -> int:
    """Benchmark the draft forward cost T_D(K) against the verify cost T_T per drafter kind."""
    from hspec.bench.draft import run_draft_bench

    return run_draft_bench(args.target, [k for k in args.drafters.split(",") if k], args.out, args.repeats,
                           _ints(args.batch_sizes), _ints(args.contexts), draft_vocab_size=args.draft_vocab,
                           dtype=args.dtype, compile_drafters=args.compile_drafter,
                           drafter_precision=args.drafter_precision)


def _add_serve(sub) -> None:
    """`hspec serve`."""
    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve the target with speculative decoding over a paged KV pool: /v1/models, "
                    "/v1/completions and /v1/chat/completions (SSE streaming with \"stream\": true), "
                    "/metrics (Prometheus) and /health. Requests are batched continuously; when the pool "
                    "is full they wait, or the youngest is preempted and later recomputed; output equals "
                    "the target's own. A client that disconnects cancels its request. Every error comes in "
                    "OpenAI's envelope. Extension: `top_k` in request bodies.")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000,
                       help="TCP port in 0..65535 (default 8000; 0 = any free port, announced at start)")
    _add_target(serve)
    _add_dtype(serve)
    _add_drafter(serve, "ngram")
    _add_pool_options(serve, default_budget_mib=512.0)
    serve.add_argument("--spec-max-batch", type=int, default=None, metavar="N",
                       help="speculate only while at most N sequences run, plain decoding steps above (default: "
                            "always speculate; 0: never). Where a batch already fills the compute, as on a small "
                            "CPU, verifying K+1 tokens per sequence costs nearly K+1 plain steps "
                            "(docs/fast-path.md#speculation-and-batch-size)")
    serve.add_argument("--kv-blocks", type=int, default=None,
                       help="pool size in blocks, >= 1 (overrides --kv-budget-mib); a pool that cannot hold one "
                            "request is refused, one that cannot give a request --default-max-tokens is warned of")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="largest request body in bytes (default 1048576 = 1 MiB); larger ones get 413 "
                            "before they are read")
    serve.add_argument("--served-model-name", default=None, help="the `model` id clients send (default: target name)")
    serve.add_argument("--default-max-tokens", type=int, default=256,
                       help="output limit of chat requests that give none, clamped to the room the prompt leaves "
                            "in the context and the KV pool (default 256; completions: OpenAI's 16, clamped too)")
    serve.add_argument("--random-drafter-weights", action="store_true",
                       help="serve a trained kind untrained (exact outputs, meaningless acceptance; for timing)")
    _add_decoding_options(serve)
    serve.add_argument("--threads", type=int, default=0,
                       help="torch CPU threads (default 0 = torch's default; 1 is faster on a busy machine)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_serve_limits(serve)
    serve.set_defaults(handler=_cmd_serve)


def _add_serve_limits(serve: argparse.ArgumentParser) -> None:
    """`hspec serve`'s access, backpressure, deadline and connection flags (hspec.serving.limits)."""
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="clients must send `Authorization: Bearer KEY` on /v1/* (default: the HSPEC_API_KEY "
                            "environment variable, which `ps` does not show; unset = open, with a warning when "
                            "--host is not loopback)")
    serve.add_argument("--max-waiting", type=int, default=None, metavar="N",
                       help="answer 503 with Retry-After while N requests wait for the engine (default: no bound)")
    serve.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="fail a request that has not finished this long after it arrived, queue time "
                            "included (default: none)")
    serve.add_argument("--max-failed-steps", type=int, default=3, metavar="N",
                       help="after N engine steps fail in a row the server answers 503, fails what is queued and "
                            "exits with status 1 for a supervisor to restart it (default 3)")
    serve.add_argument("--max-connections", type=int, default=1024, metavar="N",
                       help="open connections; more are answered 503 and closed (default 1024)")
    serve.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="close a connection that sends no complete request head for this long; a request "
                            "body not all there by then gets 408 (default 10)")
    serve.add_argument("--keep-alive-timeout", type=int, default=5, metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (default 5)")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, requests in flight get this long to finish; then each fails with an "
                            "error (streams: an error event and [DONE]) (default 30)")


def _add_pool_options(p: argparse.ArgumentParser, default_budget_mib: float) -> None:
    p.add_argument("--kv-budget-mib", type=float, default=default_budget_mib,
                   help=f"KV pool memory in MiB, target + drafter layers (default {default_budget_mib:g}); a "
                        "reduced-precision target on the CPU keeps float32 K/V, twice a bf16 pool's bytes per "
                        "token, for faster attention (docs/fast-path.md)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-running", type=int, default=128, help="largest decoding batch (default 128)")


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve the target with a drafter over an OpenAI-compatible HTTP API."""
    import os

    from hspec.serving.limits import ServingLimits
    from hspec.serving.server import ServeSettings, require_serve_extra, serve

    _check_drafter_args(args)
    limits = ServingLimits(
        api_key=args.api_key if args.api_key is not None else os.environ.get("HSPEC_API_KEY") or None,
        max_waiting=args.max_waiting, request_timeout_s=args.request_timeout, max_failed_steps=args.max_failed_steps,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        keep_alive_s=args.keep_alive_timeout, drain_timeout_s=args.drain_timeout)
    settings = ServeSettings(  # checks every value, naming its flag, before anything loads
        target=args.target, drafter=args.drafter, K=args.k, drafter_path=args.drafter_path,
        kv_budget_mib=args.kv_budget_mib, kv_blocks=args.kv_blocks, block_size=args.block_size,
        max_running=args.max_running, speculate_max_batch=args.spec_max_batch, model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=args.max_request_bytes, host=args.host, port=args.port, log_level=args.log_level,
        threads=args.threads, random_drafter_weights=args.random_drafter_weights, dtype=args.dtype,
        drafter_options=tuple(args.drafter_option), limits=limits)
    try:
        require_serve_extra()
    except ImportError as err:
        print(f"hspec: error: {err}", file=sys.stderr)
        return 2
    return serve(settings)


def _add_kv_table(sub) -> None:
    kvt = sub.add_parser("kv-table", help="KV inflation per token from model configs (the paper's Table 1)",
                         description="(target KV + drafter KV per token) / target KV for Qwen3-4B, Qwen3-8B, "
                                     "Llama-3.1-8B-Instruct and SmolLM2-135M with a 5-layer DFlash drafter and "
                                     "with H-Spec, from the models' published config values.")
    kvt.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    kvt.set_defaults(handler=_cmd_kv_table)


def _cmd_kv_table(args: argparse.Namespace) -> int:
    """Print the KV inflation per token of the known target configs (the paper's Table 1)."""
    from hspec.models.kv_accounting import format_kv_table, kv_table

    rows = kv_table()
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1), file=args.json_out)
    else:
        print(format_kv_table(rows))
    return 0


def _add_drafters(sub) -> None:
    """`hspec drafters describe`."""
    drafters = sub.add_parser("drafters", help="inspect the registered drafter kinds")
    drafters_sub = drafters.add_subparsers(dest="drafters", required=True)
    describe = drafters_sub.add_parser(
        "describe", help="parameters, drafter-side KV and per-sequence state of every kind",
        description="Per registered kind: trainable/total parameters, drafter KV bytes per token, per-sequence "
                    "state bytes and KV inflation. --target takes what `generate` takes, or a literal config "
                    "(qwen3-4b, qwen3-8b, llama-3.1-8b-instruct, smollm2-135m) built without weights.")
    _add_target(describe)
    describe.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                          help="element size for the byte counts (default bf16)")
    describe.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    describe.set_defaults(handler=_cmd_drafters_describe)


def _cmd_drafters_describe(args: argparse.Namespace) -> int:
    """Describe the registered drafter kinds: parameters, layers read, KV cost."""
    from hspec.drafters.describe import describe_kinds, format_descriptions

    described = describe_kinds(args.target, dtype=args.dtype)
    if args.json:
        print(json.dumps([r.to_dict() for r in described], indent=1), file=args.json_out)
    else:
        print(format_descriptions(described))
    return 0


if __name__ == "__main__":
    sys.exit(main())
