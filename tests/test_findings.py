"""The paper's claims tested on hand-built step logs: estimates, verdicts, and which claims apply."""

from __future__ import annotations

import pytest

from hspec.eval.runner import render_findings, render_markdown, summarize
from hspec.lab.findings import _acceptance_columns, claim_findings, evaluate_claims


def _record(method: str, item: int, num_accepted: list[int], decode_s: float = 1.0) -> dict:
    return {"task": "spec_bench", "category": "qa", "item": f"x{item}", "turn": 0, "method": method, "K": 7,
            "tokens": 1 + sum(n + 1 for n in num_accepted), "decode_s": decode_s, "num_accepted": num_accepted}


def _by_comparison(findings, metric_start: str) -> dict:
    return {f.comparison: f for f in findings if f.metric.startswith(metric_start)}


def test_acceptance_columns_count_reached_and_accepted_positions():
    # steps accepting 0, 3 and 7 drafts: position 1 reached 3 times, accepted twice; positions 4..7
    # reached 2 + 1 + 1 + 1 = 5 times (k=4 needs >= 3 accepted), accepted 4 times (only the 7).
    assert _acceptance_columns(_record("m", 0, [0, 3, 7]), range(4, 8)) == [2.0, 3.0, 4.0, 5.0]
    # positions 2..7: reached 2 + 2 + 2 + 1 + 1 + 1 = 9 times, accepted 2 + 2 + 1 + 1 + 1 + 1 = 8 times
    assert _acceptance_columns(_record("m", 0, [0, 3, 7]), range(2, 8)) == [2.0, 3.0, 8.0, 9.0]


def test_a_step_that_stopped_early_never_reached_the_next_position():
    # the middle step verified only its 3 drafts and accepted them all: it never tried position 4
    record = {**_record("m", 0, [0, 3, 7]), "num_drafted": [7, 3, 7]}
    assert _acceptance_columns(record, range(4, 8)) == [2.0, 3.0, 4.0, 4.0]


def test_hspec_lead_and_single_source_ablations():
    records = []
    for i in range(6):
        records.append(_record("hspec", i, [3, 2, 4], decode_s=0.5))
        records.append(_record("dspark", i, [1, 1, 0, 2], decode_s=0.8))
        records.append(_record("hspec-lasttoken-only", i, [5, 6, 4], decode_s=0.4))  # better than hspec
    findings = evaluate_claims(records, K=7)
    tau = _by_comparison(findings, "tau")
    assert tau["hspec vs dspark"].ci.estimate == pytest.approx((12 / 3) / (8 / 4) - 1)
    assert tau["hspec vs dspark"].verdict == "supports"
    assert tau["hspec vs hspec-lasttoken-only"].claim == "both context sources needed"
    assert tau["hspec vs hspec-lasttoken-only"].verdict == "contradicts"
    speed = _by_comparison(findings, "decode speed")["hspec vs dspark"]
    # per-token time: hspec 0.5 s / 12 tokens, dspark 0.8 s / 8 tokens
    assert speed.ci.estimate == pytest.approx((0.8 / 8) / (0.5 / 12) - 1) and speed.verdict == "supports"
    assert "hspec vs peagle" not in tau  # not run: not tested


def test_kv_reuse_decay_needs_late_positions_and_a_reference():
    records = []
    for i in range(8):
        late_stop = [1, 2, 3][i % 3]
        records.append(_record("dflash", i, [7, 5, 0, 6]))
        records.append(_record("dflash-kvreuse", i, [late_stop, late_stop + 4, 0, 4]))  # first: same; late: worse
    decay = _by_comparison(evaluate_claims(records, K=7), "acceptance gap")
    finding = decay["dflash-kvreuse vs dflash"]
    assert finding.ci.estimate < 0 and finding.verdict == "supports" and finding.prompts == 8
    assert evaluate_claims(records, K=1) == []  # no later positions in a one-token block


def test_identical_methods_leave_every_claim_unresolved():
    records = []
    for i, steps in enumerate([[1, 4, 7], [0, 2, 5], [6, 3, 1], [7, 0, 2]]):
        for method in ("hspec", "dflash", "dflash-kvreuse", "hspec-kvreuse-only"):
            records.append(_record(method, i, steps))
    findings = evaluate_claims(records, K=7)
    assert findings and all(f.verdict == "unresolved" and f.ci.estimate == pytest.approx(0.0) for f in findings)
    assert {f.claim for f in findings} == {"H-Spec leads", "both context sources needed",
                                           "direct KV reuse decays at later positions"}


def test_findings_reach_the_summary_and_markdown():
    records = []
    for i in range(4):
        records.append(_record("none", i, []))
        records.append(_record("hspec", i, [3, 2, 4], decode_s=0.5))
        records.append(_record("dflash", i, [1, 1, 0, 2], decode_s=0.8))
    assert "findings" not in summarize(records, ["none", "hspec", "dflash"], K=7)  # the library's summary alone
    summary = summarize(records, ["none", "hspec", "dflash"], K=7, findings=claim_findings)
    assert [f["verdict"] for f in summary["findings"]] == ["supports", "supports"]
    lines = render_findings(summary["findings"])
    assert any("| H-Spec leads | hspec vs dflash | tau, relative difference | +100.0%" in line for line in lines)
    payload = {"provenance": {"command": "test", "date": "d", "commit": "c",
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 2, "torch_threads": 1,
                                          "platform": "p", "torch": "t"},
                              "settings": {"K": 7, "target": "tiny", "temperature": 0.0}},
               "summary": summary}
    assert "The paper's claims, tested" in render_markdown(payload)
