"""The committed result-making scripts: every command they run exists in today's CLI, and the lookup
statistics replay the steps they measure exactly."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_script
from hspec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TRAINING_SCRIPTS = ["train_v9_questions.sh", "train_spec_bench_diag.sh"]


def _dry_run(script: str, tmp_path: Path, regenerate: bool = True) -> list[list[str]]:
    """The commands `script` would run with its default settings (DRY_RUN), split into words;
    `regenerate`: the data made anew (REGENERATE) instead of copied from the committed corpora."""
    env = {**os.environ, "DRY_RUN": "1", "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out")}
    env.pop("REGENERATE", None)
    if regenerate:
        env["REGENERATE"] = "1"
    out = subprocess.run(["bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def _without_env(words: list[str]) -> list[str]:
    """`env VAR=x cmd ...` -> `cmd ...`."""
    if words and words[0] == "env":
        words = words[1:]
        while words and re.fullmatch(r"\w+=.*", words[0]):
            words = words[1:]
    return words


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_hspec_command_parses_with_todays_cli(script, tmp_path):
    hspec_commands = [w[1:] for w in map(_without_env, _dry_run(script, tmp_path)) if w and w[0].endswith("hspec")]
    kinds = {tuple(c[:2]) if c[0] == "data" else (c[0],) for c in hspec_commands}
    assert kinds == {("data", "generate"), ("data", "features"), ("train",), ("train-report",), ("validate",)}
    parser = build_parser()
    for argv in hspec_commands:
        args = parser.parse_args(argv)  # an unknown flag exits here (SystemExit 2)
        if argv[0] == "train":  # the committed runs' recipe, pinned rather than left to defaults
            assert (args.lr, args.precision, args.seqs_per_step, args.anchors_per_seq, args.seed) == (
                3e-4, "fp32", 4, 16, 0)


def test_fast_path_evaluations_parse_with_todays_cli(tmp_path):
    commands = [w[1:] for w in map(_without_env, _dry_run("eval_fast_path.sh", tmp_path)) if w[0].endswith("hspec")]
    parser = build_parser()
    dtypes = []
    for argv in commands:
        args = parser.parse_args(argv)
        assert (argv[0], args.size, args.max_new_tokens) == ("eval", 24, 128)
        dtypes.append((args.dtype, int(args.k), args.compile_drafter, args.drafter_precision))
        assert ("_compiled" in args.name) == args.compile_drafter
        assert args.name.endswith("_drafter_floating") == (args.drafter_precision == "floating")
    assert dtypes == [("bfloat16", 7, False, "auto"), ("bfloat16", 7, True, "auto"), ("bfloat16", 7, True, "floating"),
                      ("int8", 7, False, "auto"), ("int8", 3, False, "auto")]


def test_adaptive_length_evaluations_parse_with_todays_cli(tmp_path):
    commands = [w[1:] for w in _dry_run("eval_adaptive_length.sh", tmp_path) if w[0].endswith("hspec")]
    parser = build_parser()
    runs = []
    for argv in commands:
        args = parser.parse_args(argv)
        assert (argv[0], args.size, args.max_new_tokens, args.dtype) == ("eval", 8, 128, "w4a8")
        assert {"hspec", "hspec:auto", "ngram:auto", "hspec+ngram:auto"} <= set(args.drafters.split(","))
        runs.append(args.compile_drafter)
        assert ("_compiled" in args.name) == args.compile_drafter
    assert runs == [False]


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_python_script_flag_exists(script, tmp_path):
    calls = [w[1:] for w in map(_without_env, _dry_run(script, tmp_path)) if w and w[0].endswith("python")]
    assert calls, "the script runs no python script"
    for argv in calls:
        help_text = subprocess.run([sys.executable, argv[0], "--help"], capture_output=True, text=True, check=True,
                                   cwd=ROOT).stdout
        for flag in (w for w in argv[1:] if w.startswith("--")):
            assert flag in help_text, f"{argv[0]} has no {flag}"


def test_training_stages_print_the_committed_settings(tmp_path):
    train = [w for w in map(_without_env, _dry_run("train_spec_bench_diag.sh", tmp_path)) if w[1:2] == ["train"]]
    steps = [(w[w.index("--out") + 1].rsplit("/", 1)[1], w[w.index("--steps") + 1], w[w.index("--val-every") + 1])
             for w in train]
    assert steps == [("hspec_v10_diag", "600", "100"), ("hspec_v11_diag", "2000", "500"),
                     ("hspec_v10_half_diag", "600", "100")]
    (v9,) = [w for w in map(_without_env, _dry_run("train_v9_questions.sh", tmp_path)) if w[1:2] == ["train"]]
    assert (v9[v9.index("--steps") + 1], v9[v9.index("--val-every") + 1], v9[v9.index("--init-from") + 1]) == (
        "1200", "600", "runs/train/hspec_v7/drafter")
    parts = [p.rsplit("/", 1)[1] for p in v9[v9.index("--features") + 1].split(",")]
    assert parts == [f"part{i}" for i in range(1, 14)] + [f"gpu{i}" for i in range(1, 5)] + ["part14", "part15"]


def test_match_lengths_replay_the_history_each_step_drafted_from():
    stats = load_script("lookup_match_stats")
    # Step 0 drafts from [5, 6, 7, 5, 6, 7]: its suffix 5 6 7 occurred before (m = 3); it commits 3 drafts
    # and a new token (5 6 7 8), so step 1 drafts from a history ending in 8, new (m = 0).
    assert stats.match_lengths([5, 6, 7, 5, 6], [7, 5, 6, 7, 8, 9], [3, 0], max_ngram=8) == [3, 0]
    assert stats.match_lengths([5, 6, 7, 5, 6], [7, 5, 6, 7, 8, 9], [3, 0], max_ngram=2) == [2, 0]
    # Step 0 drafts from [1, 2, 3, 1, 2] (1 2 recurs: m = 2) and commits no draft, only the new token 1;
    # step 1's history then ends 2 1, and only its last token recurs (m = 1).
    assert stats.match_lengths([1, 2, 3, 1], [2, 1, 4], [0, 0], max_ngram=8) == [2, 1]


def test_group_by_match_counts_what_trimmed_verification_would_keep():
    stats = load_script("lookup_match_stats")
    rows = stats.group_by_match([(0, 1), (1, 0), (1, 5), (2, 4), (3, 7)], K=7)
    assert [(r["match_length"], r["steps"], r["mean_accepted"]) for r in rows] == [(0, 1, 1.0), (1, 2, 2.5),
                                                                                  (2, 1, 4.0), (3, 1, 7.0)]
    assert [r["verified_if_trimmed"] for r in rows] == [None, 3, 5, 7]
    assert [r["mean_accepted_if_trimmed"] for r in rows] == [None, 1.5, 4.0, 7.0]  # m = 1: min(5, 3) = 3
    assert rows[1]["share_none_accepted"] == 0.5


def _calls(log: Path) -> list[list[str]]:
    """The recorded calls, split into words, a lab command's two words as one (`lab merge`)."""
    calls = [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]
    return [[f"lab {c[1]}", *c[2:]] if c[0] == "lab" else c for c in calls]


def _recording_hspec(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for `hspec` that appends each call to calls.txt (one write per call: the two training lanes
    call it at once, and two-part writes interleaved) and, as `hspec train` does, writes OUT/history.jsonl."""
    log, fake = tmp_path / "calls.txt", tmp_path / "hspec"
    fake.write_text(f'#!/usr/bin/env bash\nline=$(printf "%q " "$@")\necho "$line" >> {log}\n'
                    'if [ "$1" = train ]; then while [ "$1" != --out ]; do shift; done; '
                    "echo '{\"event\": \"config\"}' > \"$2/history.jsonl\"; fi\n")
    fake.chmod(0o755)
    return log, fake


def _run_compare_long(tmp_path: Path, **env: str) -> list[list[str]]:
    """scripts/compare_long.sh run with the recording stand-in and `env` (RUNS and OUT under tmp_path); its
    calls, each checked to parse with today's CLI."""
    log, fake = _recording_hspec(tmp_path)
    env = {**os.environ, "HSPEC": str(fake), "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out"), **env}
    subprocess.run(["bash", str(SCRIPTS / "compare_long.sh")], env=env, capture_output=True, text=True, check=True,
                   cwd=ROOT)
    parser = build_parser()
    for words in (shlex.split(line) for line in log.read_text().splitlines() if line.strip()):
        parser.parse_args(words)
    return _calls(log)


def test_long_comparison_runs_todays_cli_in_order(tmp_path):
    """scripts/compare_long.sh end to end with a recording stand-in for `hspec`: every command parses,
    every kind trains with the one recipe, DeLS-Spec trains last over the trained DFlash, and the claims
    come after the evaluations they read."""
    calls = _run_compare_long(tmp_path, PARTS="1 2", LANES="2")
    trained = [c[c.index("--drafter") + 1] for c in calls if c[0] == "train"]
    assert sorted(trained) == sorted(["hspec", "dflash", "peagle", "dspark", "dflash-kvreuse", "hspec-lasttoken-only",
                                      "hspec-kvreuse-only", "mamba-only", "attention-only", "hspec-nomarkov",
                                      "dflash2", "dfly", "specblock", "dels", "dflash2"])
    variant = [c for c in calls if c[0] == "train" and "--drafter-option" in c]  # hspec's DFlash-2 variant
    assert [(c[c.index("--out") + 1], c[c.index("--drafter-option") + 1]) for c in variant] == [
        (str(tmp_path / "runs" / "dflash2-selector-detached"), "selector_trains_backbone=false")]
    assert trained[-1] == "dels"
    greedy = next(c for c in calls if c[0] == "eval")  # the variant evaluates as its kind, from its own run
    assert f"dflash2={tmp_path}/runs/dflash2-selector-detached/drafter" in greedy[greedy.index("--drafters") + 1]
    dels = [c for c in calls if c[0] == "train"][-1]
    assert dels[dels.index("--init-from") + 1] == str(tmp_path / "runs" / "dflash" / "drafter")
    for c in calls:
        if c[0] == "train":
            assert c[c.index("--steps") + 1] == "3000" and c[c.index("--draft-vocab") + 1] == "8192"
            assert c[c.index("--features") + 1] == "runs/features/part1,runs/features/part2"
    order = [c[0] for c in calls]
    assert order.count("eval") == 4 and order[-4:] == ["lab merge", "train-report", "lab claims", "lab table"]
    assert all("--keep-current" in c for c in calls if c[0] == "eval")  # a retrained drafter is evaluated again
    assert all(c[c.index("--out") + 1] == str(tmp_path / "out" / "shards" / "all") for c in calls if c[0] == "eval")
    assert order.index("train-report") > max(i for i, w in enumerate(order) if w == "train")


def test_a_shard_of_the_long_comparison_trains_and_evaluates_only_its_kinds_then_merges_every_shard(tmp_path):
    """KINDS="ngram hspec dflash dels": those kinds train (dels over this shard's DFlash) and are evaluated into
    their shard's folder, the K sweep only for the parallel drafters among them; the merge reads every shard."""
    out = tmp_path / "out"
    (out / "shards" / "dspark+peagle").mkdir(parents=True)  # a shard evaluated earlier, perhaps elsewhere
    calls = _run_compare_long(tmp_path, PARTS="1", LANES="2", KINDS="ngram hspec dflash dels")
    trained = [c[c.index("--drafter") + 1] for c in calls if c[0] == "train"]
    assert sorted(trained[:2]) == ["dflash", "hspec"] and trained[2:] == ["dels"]
    evals = {c[c.index("--name") + 1]: c for c in calls if c[0] == "eval"}
    shard = str(out / "shards" / "ngram+hspec+dflash+dels")
    assert all(c[c.index("--out") + 1] == shard for c in evals.values())
    runs = tmp_path / "runs"
    assert evals["eval_spec_bench_k7_greedy"][evals["eval_spec_bench_k7_greedy"].index("--drafters") + 1] == (
        f"ngram,hspec={runs}/hspec/drafter,dflash={runs}/dflash/drafter,dels={runs}/dels/drafter")
    sweep = evals["eval_spec_bench_k_sweep_greedy"]
    assert sweep[sweep.index("--drafters") + 1] == f"hspec={runs}/hspec/drafter,dflash={runs}/dflash/drafter"
    merge = next(c for c in calls if c[0] == "lab merge")
    assert sorted(merge[1:-2]) == [f"{out}/shards/dspark+peagle/", f"{out}/shards/ngram+hspec+dflash+dels/"]
    assert [c[0] for c in calls[-2:]] == ["lab claims", "lab table"] and calls[-1][1] == str(out)
    reports = [c for c in calls if c[0] == "train-report"]  # the shard's, then every kept run's
    assert [r[r.index("--out") + 1] for r in reports] == [f"{shard}/training.md", f"{out}/training.md"]
    assert reports[0][1:4] == [f"{shard}/runs/hspec", f"{shard}/runs/dflash", f"{shard}/runs/dels"]
    assert (out / "shards" / "ngram+hspec+dflash+dels" / "runs" / "dels" / "history.jsonl").is_file()


def test_a_shard_of_dels_without_dflash_trains_its_base_dflash_without_evaluating_it(tmp_path):
    """DFlash was evaluated in another shard: DeLS-Spec's shard trains a DFlash to build on, keeps its history
    as `dels-base` (the name `dflash` belongs to the evaluated run) and evaluates dels only."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    calls = _run_compare_long(tmp_path, PARTS="1", KINDS="dels")
    trained = [c for c in calls if c[0] == "train"]
    assert [c[c.index("--drafter") + 1] for c in trained] == ["dflash", "dels"]
    assert trained[1][trained[1].index("--init-from") + 1] == f"{runs}/dflash/drafter"
    evals = [c for c in calls if c[0] == "eval"]
    assert {c[c.index("--drafters") + 1] for c in evals} == {f"dels={runs}/dels/drafter"}
    assert len(evals) == 3  # no K sweep: no parallel drafter of the paper's Table 4 in the shard
    assert sorted(p.name for p in (out / "shards" / "dels" / "runs").iterdir()) == ["dels", "dels-base"]


def test_a_shard_with_an_unknown_kind_is_refused_before_anything_runs(tmp_path):
    env = {**os.environ, "HSPEC": "false", "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out"),
           "KINDS": "hspec eagle3"}
    result = subprocess.run(["bash", str(SCRIPTS / "compare_long.sh")], env=env, capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 2 and "unknown kind 'eagle3'" in result.stderr and not (tmp_path / "runs").exists()


def test_the_dflash2_diagnostic_trains_the_variant_with_the_long_recipe_then_validates_three(tmp_path):
    """scripts/dflash2_diagnostic.sh with a recording stand-in for `hspec`: the commands parse, the variant
    trains as compare_long.sh trains DFlash-2 plus its one option, and the validation compares it with the
    two kinds it is about."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "hspec"
    fake.write_text(f'#!/usr/bin/env bash\nline=$(printf "%q " "$@")\necho "$line" >> {log}\n')
    fake.chmod(0o755)
    runs = tmp_path / "runs"
    env = {**os.environ, "HSPEC": str(fake), "RUNS": str(runs), "PARTS": "1 2"}
    subprocess.run(["bash", str(SCRIPTS / "dflash2_diagnostic.sh")], env=env, capture_output=True, text=True,
                   check=True, cwd=ROOT)
    calls = [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]
    parser = build_parser()
    for words in calls:
        parser.parse_args(words)
    train, validate = calls
    assert train[train.index("--drafter") + 1] == "dflash2" and train[train.index("--steps") + 1] == "3000"
    assert train[train.index("--draft-vocab") + 1] == "8192"
    assert train[train.index("--drafter-option") + 1] == "selector_trains_backbone=false"
    assert validate[1:4] == [str(runs / "dflash/drafter"), str(runs / "dflash2/drafter"),
                             str(runs / "dflash2-selector-detached/drafter")]


def test_merging_the_comparison_reads_every_shard_and_redraws_the_report_only_when_a_history_is_newer(tmp_path):
    """scripts/merge_comparison.sh (compare_long.sh's last step, alone): every shard folder merged, the training
    report of every kept run, then the claims and the table of the merged files; no shard: refused, saying so."""
    log, fake = _recording_hspec(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HSPEC": str(fake), "OUT": str(out)}
    script = ["bash", str(SCRIPTS / "merge_comparison.sh")]
    empty = subprocess.run(script, env=env, capture_output=True, text=True, cwd=ROOT)
    assert empty.returncode == 2 and "no shard folder" in empty.stderr and not log.exists()
    for shard, run in (("a", "hspec"), ("b", "dflash")):
        (out / "shards" / shard / "runs" / run).mkdir(parents=True)
        (out / "shards" / shard / "runs" / run / "history.jsonl").write_text("{}\n")
    subprocess.run(script, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    for line in log.read_text().splitlines():
        build_parser().parse_args(shlex.split(line))
    calls = _calls(log)
    assert [c[0] for c in calls] == ["lab merge", "train-report", "lab claims", "lab table"]
    assert calls[0][1:3] == [f"{out}/shards/a/", f"{out}/shards/b/"] and calls[0][-1] == str(out)
    assert calls[1][1:3] == [f"{out}/shards/a/runs/hspec", f"{out}/shards/b/runs/dflash"]
    (out / "training.md").write_text("a report newer than every history\n")
    log.unlink()
    subprocess.run(script, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert [c[0] for c in _calls(log)] == ["lab merge", "lab claims", "lab table"]


def _run_plan(tmp_path: Path, *shards: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """scripts/compare_long_shards.sh SHARDS... with the recording stand-in (one corpus part, RUNS and OUT
    under tmp_path): the finished process and its `hspec` calls, each checked to parse with today's CLI."""
    log, fake = _recording_hspec(tmp_path)
    env = {**os.environ, "HSPEC": str(fake), "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out"),
           "PARTS": "1"}
    done = subprocess.run(["bash", str(SCRIPTS / "compare_long_shards.sh"), *shards], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    parser = build_parser()
    for words in calls:
        parser.parse_args(words)
    return done, calls


def test_the_plan_runs_a_shard_then_the_dflash2_diagnostic_beside_shard_1s_dflash(tmp_path):
    (tmp_path / "runs" / "dflash" / "drafter").mkdir(parents=True)  # shard 1 ran on this host
    done, calls = _run_plan(tmp_path, "4")
    assert done.returncode == 0, done.stderr
    trained = [(c[c.index("--drafter") + 1], "--drafter-option" in c) for c in calls if c[0] == "train"]
    assert sorted(trained[:2]) == [("dflash2", False), ("specblock", False)] and trained[2:] == [("dflash2", True)]
    assert [c[0] for c in calls][-1] == "validate" and calls[-1][calls[-1].index("--out") + 1] == str(tmp_path / "out")
    evals = [c for c in calls if c[0] == "eval"]
    assert {c[c.index("--out") + 1] for c in evals} == {str(tmp_path / "out" / "shards" / "dflash2+specblock")}


def test_the_plan_skips_the_diagnostic_where_shard_1s_dflash_is_missing_and_refuses_unknown_shards(tmp_path):
    done, calls = _run_plan(tmp_path, "4")
    assert done.returncode == 0 and "diagnostic" in done.stderr and "skipped" in done.stderr
    assert "validate" not in [c[0] for c in calls]
    (tmp_path / "other").mkdir()
    done, calls = _run_plan(tmp_path / "other", "3", "8")
    assert done.returncode == 2 and "no shard '8'" in done.stderr and calls == []


def test_the_readme_plan_is_the_scripts_plan():
    """The long comparison's README lists the shards scripts/compare_long_shards.sh runs, in its order."""
    script = (SCRIPTS / "compare_long_shards.sh").read_text()
    plan = re.findall(r'^  "([a-z0-9 -]+)"$', script.split("SHARDS=(")[1].split(")")[0], re.M)
    readme = (ROOT / "results" / "comparison_long" / "README.md").read_text()
    rows = re.findall(r"^\| (\d) \| `([a-z0-9 -]+)` \|", readme, re.M)
    assert len(plan) == 7 and rows == [(str(i), kinds) for i, kinds in enumerate(plan, 1)]


@pytest.mark.slow
def test_describe_drafters_reproduces_the_committed_tables(tmp_path):
    """Every registered kind has its row in results/drafters_describe.{md,json}: rerun
    `bash scripts/describe_drafters.sh` after adding a kind."""
    env = {**os.environ, "OUT": str(tmp_path), "HSPEC": f"{sys.executable} -m hspec.cli"}
    subprocess.run(["bash", str(SCRIPTS / "describe_drafters.sh")], env=env, check=True, capture_output=True)
    for name in ("drafters_describe.md", "drafters_describe.json"):
        assert (tmp_path / name).read_text() == (ROOT / "results" / name).read_text(), name


def test_a_second_long_comparison_refuses_to_start_while_one_runs(tmp_path):
    """Two runs of scripts/compare_long.sh would train the same run directories: the second one exits at once."""
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {**os.environ, "HSPEC": "false", "RUNS": str(runs), "OUT": str(tmp_path / "out")}
    holder = subprocess.Popen(["flock", str(runs / ".lock"), "sleep", "30"])
    try:
        for _ in range(100):  # until the stand-in holds the lock
            if subprocess.run(["flock", "-n", str(runs / ".lock"), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        second = subprocess.run(["bash", str(SCRIPTS / "compare_long.sh")], env=env, capture_output=True, text=True,
                                cwd=ROOT, timeout=60)
    finally:
        holder.kill()
    assert second.returncode == 1 and "holds" in second.stderr
