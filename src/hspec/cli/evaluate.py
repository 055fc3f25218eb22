"""`hspec eval` (drafters against plain decoding on the task suites) and `hspec eval-report` (its markdown
and plots again from its JSON).

An evaluation's summary carries the lab's tests of the paper's claims (`hspec.lab.findings`): the
command line is the one floor that may hand lab code to the library.
"""

from __future__ import annotations

import argparse
import json

from hspec.cli.command import Command
from hspec.cli.options import (
    add_compile_drafter,
    add_data_dir,
    add_decoding_options,
    add_drafter_precision,
    add_dtype,
    add_sampling,
    add_step_cost,
    add_target,
    check_draft_len,
    ints,
    names,
    split_kind_path,
    step_cost,
)


def eval_arguments(ev: argparse.ArgumentParser) -> None:
    add_target(ev)
    add_dtype(ev)
    ev.add_argument("--drafters", default="ngram,hspec",
                    help="comma-separated kinds, optionally KIND=CHECKPOINT_DIR (plain decoding always runs)")
    ev.add_argument("--tasks", default="spec_bench", help="comma-separated task names (see hspec.data.tasks)")
    ev.add_argument("--size", type=int, default=24, help="items per task (evenly spaced, fixed; default 24)")
    ev.add_argument("--k", default="7",
                    help="draft length K, or several comma-separated (e.g. 3,5,7: the draft-length sensitivity; "
                         "each drafter runs once per K, interleaved) (default 7)")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    add_compile_drafter(ev)
    add_drafter_precision(ev)
    add_decoding_options(ev)
    add_step_cost(ev)
    add_sampling(ev)
    ev.add_argument("--out", default="results", help="output directory")
    ev.add_argument("--name", default=None, help="file stem (default eval_<tasks>_k<K>_<greedy|sampled>)")
    ev.add_argument("--keep-current", action="store_true",
                    help="where OUT/NAME.json was made with these settings and the same checkpoints (by the "
                         "digest of their weights, which the report records), keep it and decode nothing")
    add_data_dir(ev)


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate drafters against plain decoding on the task suites."""
    from pathlib import Path

    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.lab.findings import claim_findings
    from hspec.runtime import decoding_options_of
    from hspec.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    methods = [MethodSpec(*split_kind_path(spec)) for spec in names(args.drafters)]
    options = decoding_options_of([m.kind for m in methods], args.drafter_option)
    cost = step_cost(args.step_cost)
    mode = "greedy" if sampling.greedy else "sampled"
    ks = ints(args.k)
    for k in ks:
        check_draft_len(k)
    stem = args.name or f"eval_{args.tasks.replace(',', '+')}_k{'+'.join(map(str, ks))}_{mode}"
    run_eval(args.target, methods, args.tasks.split(","), args.size, ks if len(ks) > 1 else ks[0], sampling,
             args.max_new_tokens, Path(args.out), stem, args.seed, args.command_line, data_dir=args.data_dir,
             dtype=args.dtype, compile_drafters=args.compile_drafter, drafter_precision=args.drafter_precision,
             keep_current=args.keep_current, drafter_options=options, step_cost=cost, findings=claim_findings)
    print(f"report: {Path(args.out) / stem}.json and .md")
    return 0


def eval_report_arguments(erep: argparse.ArgumentParser) -> None:
    erep.add_argument("json", help="results/eval_*.json written by `hspec eval`")


def run_eval_report(args: argparse.Namespace) -> int:
    """Re-render an eval run's markdown and plots from its JSON."""
    from pathlib import Path

    from hspec.eval.runner import summarize, write_report
    from hspec.lab.findings import claim_findings

    path = Path(args.json)
    payload = json.loads(path.read_text())
    labels = list(dict.fromkeys(r["method"] for r in payload["records"]))
    k_setting = payload["provenance"]["settings"]["K"]
    payload["summary"] = summarize(payload["records"], labels, k_setting if isinstance(k_setting, int)
                                   else k_setting[0], findings=claim_findings)
    payload["provenance"]["report_command"] = f"hspec eval-report {path}"
    write_report(payload, path.parent, path.stem)
    print(f"wrote {path.with_suffix('.md')} and plots")
    return 0


COMMANDS = (
    Command("eval", "drafters vs plain decoding on the task suites (tau, speedup, CIs)", eval_arguments, run_eval,
            description="Runs plain decoding and each drafter item by item (interleaved) on fixed subsets of the "
                        "task suites; writes JSON + markdown under --out. Finished items are kept in "
                        "OUT/NAME.partial.jsonl until the report is written, so the same command run again after a "
                        "kill resumes where it stopped."),
    Command("eval-report", "re-render an eval run's markdown and plots from its JSON", eval_report_arguments,
            run_eval_report,
            description="Recompute the summary (per task and category, CIs) and the plots from the records saved "
                        "in an `hspec eval` JSON file; nothing is re-run."),
)
