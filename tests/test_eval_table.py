"""`hspec lab table`: one row per drafter across a comparison folder's evaluations, copied from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_helpers import shard_payload
from hspec import cli
from hspec.eval.labels import split_sweep_label as kind_of
from hspec.lab.claims import GREEDY_K7
from hspec.lab.table import build_table, column_title


def _history(run_dir: Path, taus: list[float]) -> None:
    """A training run's history.jsonl: its config, two of its 10 steps logged (60 s and 180 s: 20 min for the
    10 steps), a validation per tau (the last one counts)."""
    run_dir.mkdir(parents=True)
    lines = [{"event": "config", "steps": 10}, {"event": "step", "step": 0, "loss": 1.0, "seconds": 60.0},
             {"event": "step", "step": 9, "loss": 0.5, "seconds": 180.0}]
    lines += [{"event": "validation", "step": 5 * (i + 1), "mean_accepted_length": tau,
               "acceptance_by_position": [0.5], "decode_order": {"mean_accepted_length": tau - 0.25}}
              for i, tau in enumerate(taus)]
    (run_dir / "history.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def _comparison(folder: Path) -> None:
    """Two shards (hspec; dflash beside a base that was only trained), merged into `folder`."""
    for name, payload, runs in (("h", shard_payload("hspec", 2.0, [3, 4], 2.0), {"hspec": [1.5, 2.5]}),
                                ("d", shard_payload("dflash", 3.0, [1, 2], 1.5), {"dflash": [1.75],
                                                                                   "dels-base": [1.5]})):
        shard = folder / "shards" / name
        shard.mkdir(parents=True)
        (shard / f"{GREEDY_K7}.json").write_text(json.dumps(payload))
        for run, taus in runs.items():
            _history(shard / "runs" / run, taus)
    assert cli.main(["eval-merge", str(folder / "shards" / "h"), str(folder / "shards" / "d"),
                     "--out", str(folder)]) == 0


def test_each_drafter_gets_its_shard_its_last_validation_and_what_each_evaluation_measured(tmp_path):
    _comparison(tmp_path)
    table = build_table(tmp_path)
    rows = {row["drafter"]: row for row in table["rows"]}
    assert list(rows) == ["hspec", "dflash", "dels-base"]  # evaluated in run order, then trained only
    assert rows["hspec"]["shard"] == "h" and rows["dflash"]["shard"] == "d" and rows["dels-base"]["shard"] == "d"
    assert rows["hspec"]["val_tau"] == 2.5 and rows["hspec"]["val_tau_decode_order"] == 2.25
    assert rows["hspec"]["train_minutes"] == pytest.approx(20.0)
    merged = json.loads((tmp_path / f"{GREEDY_K7}.json").read_text())["summary"]["tasks"]["all"]
    (hspec,) = rows["hspec"]["evals"][GREEDY_K7]
    assert hspec["K"] == 7 and hspec["tau"] == merged["hspec"]["mean_accepted_length"]
    assert hspec["speedup"] == pytest.approx(2.0) and rows["dflash"]["evals"][GREEDY_K7][0]["speedup"] == \
        pytest.approx(1.5)
    assert rows["dels-base"]["evals"] == {}
    assert table["plain_ms_per_token"][GREEDY_K7] == merged["none"]["itl_ms"]


def test_the_command_writes_the_markdown_table(tmp_path, capsys):
    _comparison(tmp_path)
    assert cli.main(["lab", "table", str(tmp_path)]) == 0
    text = (tmp_path / "eval_table.md").read_text()
    assert "| hspec | h | 20 | 2.50 (2.25) | " in text and " / 2.00x |" in text
    assert "| dels-base | d | 20 | 1.50 (1.25) | - |" in text
    assert "| plain decoding | - | - | - | " in text and "spec_bench, K = 7, greedy (6 items a task)" in text
    assert json.loads((tmp_path / "eval_table.json").read_text())["provenance"]["command"].startswith(
        "hspec lab table ")


def test_a_variant_evaluated_from_a_run_of_another_name_shares_one_row_with_that_runs_history(tmp_path):
    """A dflash2 checkpoint in the run directory "dflash2-selector-detached" is labelled
    "dflash2@dflash2-selector-detached" by hspec eval; its history joins that row rather than a second one."""
    label = "dflash2@dflash2-selector-detached"
    shard = tmp_path / "shards" / "v"
    shard.mkdir(parents=True)
    (shard / f"{GREEDY_K7}.json").write_text(json.dumps(shard_payload(label, 3.0, [2, 3], 1.25)))
    _history(shard / "runs" / "dflash2-selector-detached", [1.5, 1.75])
    assert cli.main(["eval-merge", str(shard), "--out", str(tmp_path)]) == 0
    (row,) = build_table(tmp_path)["rows"]
    assert row["drafter"] == label and row["shard"] == "v" and row["val_tau"] == 1.75
    assert row["evals"][GREEDY_K7][0]["speedup"] == pytest.approx(1.25)


def test_a_run_kept_by_two_shards_is_refused_naming_both(tmp_path):
    _comparison(tmp_path)
    _history(tmp_path / "shards" / "h" / "runs" / "dflash", [1.0])
    with pytest.raises(ValueError, match="run 'dflash': d and h"):
        build_table(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_table(tmp_path / "nowhere")


def test_labels_and_titles():
    assert kind_of("hspec k=5") == ("hspec", 5) and kind_of("dflash-kvreuse") == ("dflash-kvreuse", None)
    assert column_title({"tasks": "mt_bench,gsm8k", "K": [3, 5, 7], "temperature": 1.0, "size_per_task": 16}) == \
        "mt_bench, gsm8k, K = 3/5/7, T = 1 (16 items a task)"
