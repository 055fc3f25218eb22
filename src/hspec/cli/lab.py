"""`hspec lab claims|merge|table|scaling`: the research tooling over a comparison's evaluations (`hspec.lab`).

They read and write results folders of `hspec eval` JSONs: the shards of a long comparison merged into
one evaluation, the paper's claims tested on them, and one table of every drafter across them; `scaling`
trains one recipe at several budgets and reports tau against the budget. Their
earlier names (`hspec claims`, `hspec eval-merge`, `hspec eval-table`), which scripts/ runs, still parse,
as commands left out of `hspec --help`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from hspec.cli.command import Command, group
from hspec.cli.options import add_training_precision


def merge_arguments(merge: argparse.ArgumentParser) -> None:
    merge.add_argument("shards", nargs="+", help="shard directories, each holding eval JSONs; merged in the order "
                                                 "they were evaluated, the first one's plain decoding kept")
    merge.add_argument("--out", required=True, help="output directory of the merged JSONs, markdown and plots")


def run_merge(args: argparse.Namespace) -> int:
    """Merge shard evaluations into one per file stem."""
    from hspec.lab.merge import merge_shards

    for path in merge_shards([Path(d) for d in args.shards], Path(args.out), args.command_line):
        print(f"wrote {path} and its markdown")
    return 0


def claims_arguments(claims: argparse.ArgumentParser) -> None:
    claims.add_argument("folder", help="results folder holding the eval JSONs, e.g. results/comparison_long")
    claims.add_argument("--out", default=None, help="output directory (default: the folder itself)")
    claims.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default 0)")


def run_claims(args: argparse.Namespace) -> int:
    """Test the paper's claims on a folder's eval JSONs; print each verdict, write claims.json and .md."""
    from hspec.lab.claims import write_claims

    json_path, md_path = write_claims(Path(args.folder), None if args.out is None else Path(args.out),
                                      args.command_line, seed=args.seed)
    for claim in json.loads(json_path.read_text())["claims"]:
        print(f"{claim['name']} ({claim['source']}): {claim['verdict']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


def table_arguments(table: argparse.ArgumentParser) -> None:
    table.add_argument("folder", help="results folder, e.g. results/comparison_long")
    table.add_argument("--out", default=None, help="output directory (default: the folder itself)")


def run_table(args: argparse.Namespace) -> int:
    """Write one table of every drafter across a folder's evaluations."""
    from hspec.lab.table import write_table

    json_path, md_path = write_table(Path(args.folder), None if args.out is None else Path(args.out),
                                     args.command_line)
    print(f"wrote {json_path} and {md_path}")
    return 0


def scaling_arguments(scaling: argparse.ArgumentParser) -> None:
    scaling.add_argument("--target", default="smollm2", help="the target (default: the embedded SmolLM2-135M-Instruct)")
    scaling.add_argument("--kind", default="hspec", help="drafter kind to train (default hspec)")
    scaling.add_argument("--budgets", default="6400,12800,25600,51200,102400,204800",
                         help="blocks of each run, comma-separated, each a multiple of one step's blocks "
                              "(default 6400,12800,25600,51200,102400,204800: doublings from 100 steps)")
    scaling.add_argument("--features", default=",".join(f"runs/features/part{i}" for i in range(1, 8)),
                         help="training feature caches, comma-separated (default: parts 1-7 of "
                              "results/train_data, the shipped drafter's first run's, as "
                              "scripts/train_hspec_smollm2.sh caches them)")
    scaling.add_argument("--runs-dir", default="runs/scaling",
                         help="where each budget's run directory, the Spec-Bench features and the reference's "
                              "measurements live, kept across sessions (default runs/scaling)")
    scaling.add_argument("--spec-bench-corpus", default="results/spec_bench_split_diag/corpus_spec_bench_split.jsonl",
                         help="the target's greedy responses to Spec-Bench prompts (default: the committed first "
                              "turns outside `hspec eval`'s subset)")
    scaling.add_argument("--spec-bench-per-category", type=int, default=16,
                         help="responses measured per Spec-Bench category (default 16)")
    scaling.add_argument("--val-sequences", type=int, default=24, help="held-out sequences measured (default 24)")
    scaling.add_argument("--reference", default="shipped",
                         help="a drafter measured alongside, apart from the curve: a directory, 'shipped' (the "
                              "kind's shipped drafter for the target, where there is one) or 'none'")
    scaling.add_argument("--reference-blocks", type=int, default=None,
                         help="the blocks the reference was trained on, to place it on the x axis and compare it "
                              "with the line (default: 1,152,000 for the shipped H-Spec drafter, the 18,000 steps "
                              "of 64 blocks of docs/results.md#the-shipped-drafter; none otherwise)")
    scaling.add_argument("--seqs-per-step", type=int, default=4)
    scaling.add_argument("--anchors-per-seq", type=int, default=16)
    scaling.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    scaling.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary Vp (default 8192)")
    scaling.add_argument("--seed", type=int, default=0)
    add_training_precision(scaling, "as `hspec train --precision`")
    scaling.add_argument("--tau-goal", default="2.0,2.7",
                         help="Spec-Bench and held-out tau whose budget the fit estimates (default: the issue's "
                              "goals, 2.0,2.7)")
    scaling.add_argument("--no-train", action="store_true",
                         help="train nothing: measure the finished runs and write the report")
    scaling.add_argument("--out", default="results/scaling_curve", help="output directory")
    scaling.add_argument("--name", default=None, help="file stem (default scaling_<kind>)")


# The blocks each shipped drafter trained on, by kind. H-Spec: 5,000 + 3,500 + 6,000 + 2,000 + 1,500 steps of
# 4 x 16 blocks (scripts/train_hspec_smollm2.sh, results/train_hspec_smollm2.md).
SHIPPED_BLOCKS = {"hspec": 18_000 * 64}
# The --reference value that measures no drafter alongside the curve.
NO_REFERENCE = "none"


def run_scaling(args: argparse.Namespace) -> int:
    """Train the budgets (resuming), measure them and write the curve's report."""
    import os
    import time

    from hspec.cli.options import ints, names
    from hspec.lab.scaling import CurvePlan, Recipe, plan_settings, reference_point, run_curve
    from hspec.lab.scaling_report import write_curve_report
    from hspec.models.loading import load_target
    from hspec.runtime import shipped_drafter_path

    recipe = Recipe(kind=args.kind, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                    lr=args.lr, draft_vocab=args.draft_vocab, seed=args.seed, precision=args.precision)
    goals = [float(x) for x in names(args.tau_goal)]
    if len(goals) != 2:
        raise ValueError(f"--tau-goal takes two values (Spec-Bench, held out), got {args.tau_goal!r}")
    target = load_target(args.target)
    reference = None if args.reference == NO_REFERENCE else (
        shipped_drafter_path(args.kind, target.name) if args.reference == "shipped" else Path(args.reference))
    reference_blocks = args.reference_blocks
    if reference is not None and args.reference == "shipped":
        reference = Path(os.path.relpath(reference)) if reference.is_relative_to(Path.cwd()) else reference
        if reference_blocks is None:
            reference_blocks = SHIPPED_BLOCKS.get(args.kind)
    if reference is not None and not (reference / "config.json").exists():
        if args.reference != "shipped":
            raise FileNotFoundError(f"no drafter at --reference {reference}")
        reference = None  # the kind ships no drafter for this target
    plan = CurvePlan(recipe, tuple(ints(args.budgets)), tuple(Path(p) for p in names(args.features)),
                     Path(args.runs_dir), Path(args.spec_bench_corpus), args.spec_bench_per_category,
                     args.val_sequences, reference, reference_blocks, args.target)

    def progress(message: str) -> None:
        print(f"[scaling {time.strftime('%H:%M:%S')}] {message}", flush=True)

    points = run_curve(plan, train_runs=not args.no_train, target=target, progress=progress)
    json_path, md_path = write_curve_report(points, reference_point(plan), plan_settings(plan), Path(args.out),
                                            args.name or f"scaling_{args.kind}", args.command_line,
                                            {"spec_bench": goals[0], "held_out": goals[1]})
    print(f"wrote {json_path} and {md_path} ({len(points)} finished runs of {len(plan.budgets)})")
    return 0


MERGE = Command("merge", "one evaluation from shards evaluated apart (scripts/compare_long.sh)", merge_arguments,
                run_merge,
                description="Merges, file stem by file stem, the `hspec eval` JSONs of shard directories (the same "
                            "evaluation run for different drafters, possibly on other machines) into OUT, as one run "
                            "would have written them. Shards must share every setting but their drafters; each "
                            "drafter's speedup stays over its own shard's plain decoding, and drafters are paired "
                            "only on turns where their shards' plain outputs agree (docs/claims.md#shards).")
CLAIMS = Command("claims", "the paper's claims tested on a comparison's eval JSONs (docs/claims.md)", claims_arguments,
                 run_claims,
                 description="Reads the `hspec eval` JSONs of a results folder (as scripts/compare_long.sh names "
                             "them) and, per claim of the H-Spec paper (Tables 2-4, Fig. 4, Fig. 7, the Markov head), "
                             "gives paired bootstrap 95% CIs over items and a verdict: reproduced (in part, while a "
                             "pair it names is in no file), contradicted or unresolved; a claim whose file or drafter "
                             "is missing is skipped, saying why. Writes claims.json and claims.md.")
TABLE = Command("table", "every drafter of a comparison folder on one row, across its evaluations", table_arguments,
                run_table,
                description="Reads the eval JSONs of a results folder (the files `hspec lab claims` reads) and the "
                            "training histories its shards kept (shards/*/runs/*/history.jsonl), and writes "
                            "eval_table.json and eval_table.md: per drafter kind its shard, its training time, its "
                            "last validation tau and, per evaluation, its tau and speedup over plain decoding as "
                            "that evaluation states them. The folder's README.md quotes this table.")
SCALING = Command("scaling", "one recipe at several budgets of blocks: tau against the budget (issue 54)",
                  scaling_arguments, run_scaling,
                  description="Trains the recipe (the shipped drafter's batch, optimizer and loss) from scratch at "
                              "each budget of blocks, each run in its own directory under --runs-dir with its "
                              "schedule ending at its budget; measures each finished run's greedy tau and "
                              "first-position acceptance in decode order on the held-out split and on the target's "
                              "responses to Spec-Bench prompts; writes JSON, markdown and a PNG of tau against "
                              "log2(blocks) with the fit per doubling (src/hspec/lab/scaling.py). Rerun the same "
                              "command to resume after a kill.")
LAB_COMMANDS = (MERGE, CLAIMS, TABLE, SCALING)

COMMANDS = (Command("lab", "research tooling: merge a comparison's shards, test the paper's claims, tabulate",
                    group(LAB_COMMANDS, "lab")),)
# The lab commands' names from before `hspec lab`, as scripts/compare_long.sh and merge_comparison.sh run them.
HIDDEN = (replace(MERGE, name="eval-merge"), CLAIMS, replace(TABLE, name="eval-table"))
