"""`hspec lab claims|merge|table`: the research tooling over a comparison's evaluations (`hspec.lab`).

They read and write results folders of `hspec eval` JSONs: the shards of a long comparison merged into
one evaluation, the paper's claims tested on them, and one table of every drafter across them. Their
earlier names (`hspec claims`, `hspec eval-merge`, `hspec eval-table`), which scripts/ runs, still parse,
as commands left out of `hspec --help`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from hspec.cli.command import Command, group


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
LAB_COMMANDS = (MERGE, CLAIMS, TABLE)

COMMANDS = (Command("lab", "research tooling: merge a comparison's shards, test the paper's claims, tabulate",
                    group(LAB_COMMANDS, "lab")),)
# The lab commands' names from before `hspec lab`, as scripts/compare_long.sh and merge_comparison.sh run them.
HIDDEN = (replace(MERGE, name="eval-merge"), CLAIMS, replace(TABLE, name="eval-table"))
