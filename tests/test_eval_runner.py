"""The evaluation summary on hand-built records: tau, speedup, per-category groups, CIs, plots."""

from __future__ import annotations

import pytest

from hspec.eval.runner import render_markdown, summarize


def _records():
    rows = []
    for i, category in enumerate(["qa", "qa", "translation", "translation"]):
        common = {"task": "spec_bench", "category": category, "item": f"x{i}", "turn": 0, "tokens": 11}
        rows.append({**common, "method": "none", "decode_s": 1.0, "num_accepted": []})
        rows.append({**common, "method": "a", "decode_s": 0.5, "num_accepted": [3, 1, 0]})  # tau 7/3
        rows.append({**common, "method": "b", "decode_s": 0.8, "num_accepted": [0, 1, 0, 1]})  # tau 6/4
    return rows


def test_tau_speedup_and_groups():
    summary = summarize(_records(), ["none", "a", "b"], K=3)
    assert set(summary["tasks"]) == {"spec_bench/qa", "spec_bench/translation", "spec_bench", "all"}
    a, b = summary["tasks"]["all"]["a"], summary["tasks"]["all"]["b"]
    assert a["mean_accepted_length"] == pytest.approx(7 / 3) and b["mean_accepted_length"] == pytest.approx(1.5)
    assert a["speedup"] == pytest.approx(2.0) and b["speedup"] == pytest.approx(1.25)
    assert a["acceptance_by_position"][0] == pytest.approx(2 / 3)
    ci = summary["ci"]["a vs b"]["tau_relative_diff"]
    assert ci["estimate"] == pytest.approx((7 / 3) / 1.5 - 1) and ci["low"] <= ci["estimate"] <= ci["high"]


def test_markdown_and_plots(tmp_path):
    from hspec.eval.plots import plot_eval

    summary = summarize(_records(), ["none", "a", "b"], K=3)
    payload = {"provenance": {"command": "test", "date": "d", "commit": "c",
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 2, "torch_threads": 1,
                                          "platform": "p", "torch": "t"},
                              "settings": {"K": 3, "target": "tiny", "temperature": 0.0}},
               "summary": summary}
    text = render_markdown(payload)
    assert "| spec_bench/qa |" in text and "a vs b" in text
    paths = plot_eval(summary, tmp_path / "run", "test")
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)
