"""The diagnostic Spec-Bench training split never holds an item we measure or tune on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import load_script
from hspec.data.tasks import default_data_dir, load_task

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_split_leaves_out_the_evaluated_and_the_tuning_items(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    split = load_script("build_spec_bench_diagnostic_split")
    out = tmp_path / "split.jsonl"
    monkeypatch.setattr(sys, "argv", ["build_spec_bench_diagnostic_split.py", str(out)])
    assert split.main() == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [json.loads(line) for line in (default_data_dir() / "spec_bench.jsonl").read_text().split("\n") if line]
    evaluated = {item.id for item in load_task("spec_bench", split.EVALUATED_SIZE).items}
    tuned = {row["id"] for items in split.dev_items(rows).values() for row in items}
    kept_ids = {row["id"] for row in kept}
    assert (len(evaluated), len(tuned)) == (24, 18)
    assert not kept_ids & (evaluated | tuned)
    assert kept_ids | evaluated | tuned == {row["id"] for row in rows}  # nothing else is left out
    assert all(len(row["turns"]) == 1 for row in kept)
