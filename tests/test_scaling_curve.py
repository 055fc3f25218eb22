"""`hspec lab scaling`: the recipe at several budgets, measured per sequence, and the curve's statistics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hspec.data.tasks import load_task
from hspec.drafters.checkpoint import load_drafter
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.lab.scaling import CurvePlan, Recipe, plan_settings, reference_point, run_curve, spec_bench_subset
from hspec.lab.scaling_report import (
    blocks_at,
    curve_statistics,
    fit_line,
    reference_statistics,
    tau_and_first,
    write_curve_report,
)
from hspec.training.run import is_validation
from hspec.training.store import FeatureStore, FeatureStores
from hspec.training.trainer import TrainConfig, Trainer


def test_a_budget_is_a_whole_number_of_steps_and_budgets_ascend():
    recipe = Recipe(seqs_per_step=4, anchors_per_seq=16)
    assert recipe.steps_for(12800) == 200 and recipe.config(12800).steps == 200
    with pytest.raises(ValueError, match="multiple of 64"):
        recipe.steps_for(100)
    with pytest.raises(ValueError, match="ascending"):
        CurvePlan(recipe, (128, 64), (Path("f"),), Path("r"), Path("c"))
    with pytest.raises(ValueError, match="trained drafter kind"):
        Recipe(kind="ngram")


def test_tau_first_acceptance_and_the_fit_from_histograms():
    # Two sequences, K = 2: sequence 0 took steps accepting 0 and 2, sequence 1 one step accepting 1.
    hist = np.array([[[1, 0, 1], [0, 1, 0]]], dtype=float)  # (P=1, N=2, K+1=3)
    tau, first = tau_and_first(hist)
    assert tau[0] == pytest.approx((1 + 3 + 2) / 3) and first[0] == pytest.approx(2 / 3)
    x = np.log2([1000.0, 2000.0, 4000.0])
    a, b = fit_line(x, 0.5 + 0.1 * x)
    assert a == pytest.approx(0.5) and b == pytest.approx(0.1)
    assert blocks_at(0.5 + 0.1 * 13, np.array(a), np.array(b)) == pytest.approx(2**13)
    assert np.isinf(blocks_at(3.0, np.array(1.0), np.array(-0.1)))


def _point(blocks: int, per_seq: list[list[int]]) -> dict:
    hist = {f"s{i}": h for i, h in enumerate(per_seq)}
    return {"blocks": blocks, "measured": {"K": 2, "held_out": hist, "spec_bench": hist}}


def test_the_slope_interval_pairs_sequences_across_points():
    # Every sequence gains exactly one accepted step per doubling, while the sequences differ widely: the
    # per-point intervals are wide, the paired slope's is a point.
    rng = np.random.default_rng(1)
    base = [[int(n), 4, 2] for n in rng.integers(1, 40, size=12)]
    points = [_point(1000 * 2**d, [[h[0] - d, h[1] + d, h[2]] for h in base]) for d in range(3)]
    stats = curve_statistics(points, "held_out", tau_goal=1.5, resamples=300)
    slope = stats["fit"]["slope_per_doubling"]
    assert stats["tau"][0]["high"] - stats["tau"][0]["low"] > 0.01
    point_width = stats["tau"][0]["high"] - stats["tau"][0]["low"]
    assert slope["estimate"] > 0 and slope["high"] - slope["low"] < 0.5 * point_width
    tau = [t["estimate"] for t in stats["tau"]]
    assert tau[0] < tau[1] < tau[2]


def test_the_reference_is_compared_with_the_line_at_its_own_budget():
    # Each doubling moves one step per sequence from 0 to 1 accepted; the reference, at 8x the last point's blocks,
    # is exactly where the line continues, so it is 0 above it.
    base = [[40, 10, 0], [30, 20, 0]]
    points = [_point(1000 * 2**d, [[h[0] - d, h[1] + d, 0] for h in base]) for d in range(3)]
    on_line = _point(0, [[h[0] - 5, h[1] + 5, 0] for h in base])
    stats = reference_statistics({"blocks": 32000, "measured": on_line["measured"]}, points, "held_out", resamples=200)
    assert stats["above_fit"]["estimate"] == pytest.approx(0.0, abs=1e-12)
    assert stats["fit_at_blocks"]["estimate"] == pytest.approx(stats["tau"]["estimate"])
    assert reference_statistics({"blocks": None, "measured": on_line["measured"]}, points, "held_out").keys() == {
        "blocks", "tau", "first_acceptance"}


def _validation_ids(count: int) -> list[str]:
    return [f"seq/{i}" for i in range(400) if is_validation(f"seq/{i}")][:count]


@pytest.fixture()
def curve_inputs(tmp_path, tiny_target) -> tuple[Path, Path]:
    """A feature cache of 4 training and 2 held-out sequences of the tiny target, and a 'Spec-Bench' corpus of
    three responses to real Spec-Bench items (two categories)."""
    g = torch.Generator().manual_seed(7)
    V = tiny_target.config.vocab_size
    ids = [f"seq/{i}" for i in range(1, 40) if not is_validation(f"seq/{i}")][:4] + _validation_ids(2)
    records = [{"id": i, "prompt_ids": torch.randint(3, V, (8,), generator=g).tolist(),
                "response_ids": torch.randint(3, V // 2, (30,), generator=g).tolist()} for i in ids]
    layers = select_target_layers(tiny_target.config.num_layers)
    FeatureStore.build(tmp_path / "features", tiny_target.model, tiny_target.name, records, layers,
                       [kv_layer_of(x) for x in layers])
    items = load_task("spec_bench", None).items
    chosen = [it for it in items if it.category == "qa"][:2] + [it for it in items if it.category == "rag"][:1]
    corpus = tmp_path / "spec_bench.jsonl"
    corpus.write_text("".join(json.dumps({"id": it.id, "prompt_ids": torch.randint(3, V, (12,), generator=g).tolist(),
                                          "response_ids": torch.randint(3, V, (20,), generator=g).tolist()}) + "\n"
                              for it in reversed(chosen)))
    return tmp_path / "features", corpus


def test_spec_bench_subset_takes_the_first_items_of_each_category(curve_inputs):
    _, corpus = curve_inputs
    chosen = spec_bench_subset(corpus, per_category=1)
    assert [r["category"] for r in chosen] == ["qa", "rag"]
    qa = sorted((it.id for it in load_task("spec_bench", None).items if it.category == "qa"),
                key=lambda i: int(i.rsplit("/", 1)[1]))
    assert chosen[0]["id"] == qa[0]


def test_the_curve_trains_each_budget_from_scratch_measures_it_and_resumes(tmp_path, tiny_target, curve_inputs):
    features, corpus = curve_inputs
    recipe = Recipe(seqs_per_step=2, anchors_per_seq=4, draft_vocab=32, precision="fp32")
    plan = CurvePlan(recipe, (8, 16), (features,), tmp_path / "runs", corpus, spec_bench_per_category=2,
                     val_sequences=2, target="tiny")
    messages: list[str] = []
    points = run_curve(plan, target=tiny_target, progress=messages.append)
    assert [p["blocks"] for p in points] == [8, 16] and [p["steps"] for p in points] == [1, 2]
    # Each run's schedule ends at its own budget: a run of its own, not a checkpoint of the longer one.
    assert json.loads((plan.run_dir(16) / "history.jsonl").read_text().splitlines()[0])["steps"] == 2
    # The per-sequence histograms add up to the validation of all the held-out sequences at once.
    store = FeatureStores([features])
    val = [i for i in store.available() if is_validation(store.ids[i])]
    drafter = load_drafter(plan.run_dir(16) / "drafter", tiny_target.model)
    whole = Trainer(drafter, tiny_target.model, store.load, val, TrainConfig(steps=1)).validate_in_decode_order(val)
    summed = np.sum(list(points[1]["measured"]["held_out"].values()), axis=0)
    assert summed.tolist() == list(whole.accepted_count_histogram)
    assert len(points[1]["measured"]["held_out"]) == 2 and len(points[1]["measured"]["spec_bench"]) == 3
    # A rerun trains and measures nothing again.
    cache = plan.run_dir(8) / "curve_eval.json"
    stamp = cache.stat().st_mtime_ns
    again = run_curve(plan, target=tiny_target, progress=messages.append)
    assert cache.stat().st_mtime_ns == stamp and [p["measured"] for p in again] == [p["measured"] for p in points]
    # The shipped-style reference is measured apart from the curve, on the same sequences.
    with_reference = CurvePlan(recipe, (8, 16), (features,), tmp_path / "runs", corpus, 2, 2,
                               reference=plan.run_dir(8) / "drafter", target="tiny")
    run_curve(with_reference, train_runs=False, target=tiny_target, progress=messages.append)
    reference = reference_point(with_reference)
    assert reference is not None and reference["measured"]["held_out"] == points[0]["measured"]["held_out"]
    json_path, md_path = write_curve_report(again, reference, plan_settings(with_reference), tmp_path / "out",
                                            "scaling_hspec", "hspec lab scaling", {"spec_bench": 2.0, "held_out": 2.7})
    payload = json.loads(json_path.read_text())
    assert set(payload["summary"]["sets"]) == {"held_out", "spec_bench"}
    assert "fit" in payload["summary"]["sets"]["spec_bench"] and (tmp_path / "out" / "scaling_hspec.png").exists()
    assert "reference" in md_path.read_text()


def test_the_script_runs_commands_of_todays_cli(tmp_path):
    import os
    import shlex
    import subprocess

    from hspec.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DRY_RUN": "1", "RUNS": str(tmp_path / "runs"), "KIND": "dflash", "BUDGETS": "64,128"}
    out = subprocess.run(["bash", str(root / "scripts" / "scaling_curve.sh")], env=env, capture_output=True,
                         text=True, check=True, cwd=root).stdout
    commands = [shlex.split(line[2:])[1:] for line in out.splitlines() if line.startswith("+ ")]
    assert [c[:2] for c in commands] == [["data", "features"]] * 7 + [["lab", "scaling"]]
    args = build_parser().parse_args(commands[-1])
    assert (args.kind, args.budgets, args.runs_dir) == ("dflash", "64,128", str(tmp_path / "runs"))
    assert args.features.split(",") == [f"runs/features/part{i}" for i in range(1, 8)]
