"""`hspec data generate|features`, `hspec train`, `hspec validate` and `hspec train-report`: a drafter
trained for a target, from the target's own responses to its validation tau and loss curves."""

from __future__ import annotations

import argparse
from pathlib import Path

from hspec.cli.command import Command, group
from hspec.cli.options import add_data_dir, add_device, add_sampling, add_target, add_training_precision


def paths(text: str) -> list[Path]:
    """'a,b' -> [Path('a'), Path('b')]: the comma-separated folders or files of one flag."""
    return [Path(p) for p in text.split(",")]


def data_generate_arguments(dgen: argparse.ArgumentParser) -> None:
    add_target(dgen)
    dgen.add_argument("--prompts", default="train_prompts.jsonl",
                      help="prompt JSONL (normalized format): a path, or a file (or its .gz) in the data folder "
                           "(default train_prompts.jsonl: the shipped training prompts)")
    add_data_dir(dgen)
    dgen.add_argument("--num-prompts", type=int, default=None, help="how many prompts (default all)")
    dgen.add_argument("--skip-prompts", type=int, default=0,
                      help="start this far into the shuffled prompt order, so corpus parts made by separate "
                           "(parallel) runs never overlap (default 0)")
    dgen.add_argument("--max-prompt-tokens", type=int, default=384)
    dgen.add_argument("--max-new-tokens", type=int, default=256)
    dgen.add_argument("--batch-size", type=int, default=16)
    add_sampling(dgen)
    add_device(dgen, default="cpu")
    dgen.add_argument("--out", default="runs/data/smollm2_responses.jsonl", help="output JSONL")


def run_data_generate(args: argparse.Namespace) -> int:
    """Generate the target's responses to the training prompts (resumable)."""
    from hspec.training.datagen import DataGenSettings, generate_corpus

    settings = DataGenSettings(
        target=args.target, prompts_file=args.prompts, num_prompts=args.num_prompts,
        skip_prompts=args.skip_prompts, max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, batch_size=args.batch_size, shuffle_seed=args.seed, device=args.device,
        data_dir=args.data_dir)
    print(f"wrote {generate_corpus(settings, Path(args.out))}")
    return 0


def data_features_arguments(dfeat: argparse.ArgumentParser) -> None:
    add_target(dfeat)
    dfeat.add_argument("--corpus", default="runs/data/smollm2_responses.jsonl", help="output of `data generate`")
    dfeat.add_argument("--out", default="runs/features/smollm2", help="feature cache directory")
    dfeat.add_argument("--max-sequences", type=int, default=None)
    add_device(dfeat, default="cpu")


def run_data_features(args: argparse.Namespace) -> int:
    """Cache the target features every drafter trains from (resumable)."""
    from hspec.training.run import build_features

    cache = build_features(args.target, Path(args.corpus), Path(args.out), args.max_sequences, args.device)
    print(f"wrote {cache}")
    return 0


DATA_COMMANDS = (
    Command("generate", "generate the target's responses to training prompts (resumable)", data_generate_arguments,
            run_data_generate,
            description="Batched greedy (or sampled) responses of the target to the training prompts, appended to "
                        "a JSONL file; rerun the same command to resume."),
    Command("features", "cache the target features all drafters train from (resumable)", data_features_arguments,
            run_data_features,
            description="Run the target once over every generated sequence and cache the selected layers' hidden "
                        "states, their K/V and the final hidden state."),
)


def train_arguments(train: argparse.ArgumentParser) -> None:
    add_target(train)
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
    add_training_precision(train, "arithmetic of the drafter's forward and backward: fp32, or bf16 autocast over fp32 "
                                  "master weights, optimizer state and loss. auto: bf16-autocast on CUDA and on a CPU "
                                  "with native bf16 dot products (AVX512-BF16/AMX), else fp32 (measured: "
                                  "results/train_precision_cpu.md); a resumed run keeps the precision it recorded")
    train.add_argument("--compile-step", action="store_true",
                       help="run each step's forward and loss through torch.compile (compiled on the first step: "
                            "minutes on a CPU; results/train_throughput/ measures what it buys)")
    add_device(train)


def run_train(args: argparse.Namespace) -> int:
    """Train (or resume training) a drafter with the unified recipe."""
    from hspec.drafters import DRAFTERS
    from hspec.drafters.base import parse_config_options
    from hspec.training.memory import retain_freed_memory
    from hspec.training.run import train as run_training
    from hspec.training.trainer import TrainConfig

    retain_freed_memory()  # a step's large tensors reuse freed memory instead of faulting in fresh pages
    config = TrainConfig(steps=args.steps, lr=args.lr, seqs_per_step=args.seqs_per_step,
                         anchors_per_seq=args.anchors_per_seq, seed=args.seed,
                         cod_keep=DRAFTERS.get(args.drafter).trains_with_cod, precision=args.precision,
                         compile=args.compile_step)
    out = Path(args.out or f"runs/train/{args.drafter}")
    saved = run_training(args.drafter, args.target, paths(args.features), out,
                         config, val_every=args.val_every, draft_vocab_size=args.draft_vocab,
                         init_from=None if args.init_from is None else Path(args.init_from),
                         corpora=None if args.corpus is None else paths(args.corpus),
                         device=args.device, override=args.override, save_minutes=args.save_minutes,
                         drafter_options=parse_config_options(args.drafter, args.drafter_option))
    print(f"wrote {saved}")
    return 0


def validate_arguments(val: argparse.ArgumentParser) -> None:
    add_target(val)
    val.add_argument("drafters", nargs="+", help="drafter directories (RUN/drafter or an exported drafter)")
    val.add_argument("--features", default="runs/features/smollm2",
                     help="feature cache dir(s) from `data features`, comma-separated (as given to `hspec train`)")
    val.add_argument("--val-sequences", type=int, default=24, help="held-out sequences to use (default 24)")
    val.add_argument("--out", default="results", help="output directory (default results)")
    val.add_argument("--name", default="validation", help="file stem (default validation)")


def run_validate(args: argparse.Namespace) -> int:
    """Measure validation tau of saved drafters on the held-out training split."""
    from hspec.training.run import validate_drafters

    _, md = validate_drafters(args.target, paths(args.features), [Path(d) for d in args.drafters], Path(args.out),
                              args.val_sequences, args.name)
    print(f"wrote {md}")
    return 0


def train_report_arguments(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("runs", nargs="+", help="run directories of `hspec train`")
    rep.add_argument("--out", default="results/train_report.md")
    rep.add_argument("--title", default="Drafter training")


def run_train_report(args: argparse.Namespace) -> int:
    """Write loss curves and validation acceptance of training runs."""
    from hspec.training.report import write_training_report

    print(f"wrote {write_training_report([Path(r) for r in args.runs], Path(args.out), args.title)}")
    return 0


COMMANDS = (
    Command("data", "training data: the target's own responses", group(DATA_COMMANDS, "data")),
    Command("train", "train a drafter with the unified recipe (resumable; torchrun for DDP)", train_arguments,
            run_train,
            description="0.1 CE + 0.9 TV with position weights exp(-(k-1)/4), AdamW, 1% warmup then half-cosine. "
                        "Rerun the same command to resume after a kill."),
    Command("validate", "validation tau of saved drafters on the held-out training split", validate_arguments,
            run_validate,
            description="Greedy teacher-forced acceptance of each drafter on the held-out sequences `hspec train` "
                        "validates on: over uniformly drawn anchors and in decode order (the anchors greedy "
                        "decoding visits). Writes JSON + markdown."),
    Command("train-report", "loss curves + validation acceptance of training runs (markdown + PNG)",
            train_report_arguments, run_train_report),
)
