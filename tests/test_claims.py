"""`hspec claims` on hand-built eval JSONs: verdicts, the item as the unit, and every way a claim is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hspec import cli
from hspec.lab.claims import (
    CLAIMS,
    FIRST_LATE_POSITION,
    GREEDY_K7,
    K_SWEEP,
    LATE_ACCEPTANCE,
    SAMPLED_K7,
    SPEEDUP,
    TASKS_K7,
    TAU,
    _item_position_counts,
    check_claims,
    load_evals,
    write_claims,
)
from hspec.metrics import acceptance_stats

RESAMPLES = 2000


def _record(method: str, item: int, num_accepted: list[int], decode_s: float = 1.0, turn: int = 0, K: int = 7,
            task: str = "spec_bench") -> dict:
    return {"task": task, "category": "qa", "item": f"{task}/{item}", "turn": turn, "method": method, "K": K,
            "tokens": 1 + sum(n + 1 for n in num_accepted), "decode_s": decode_s, "num_accepted": num_accepted}


def _payload(records: list[dict], temperature: float = 0.0, K: int | list[int] = 7) -> dict:
    return {"provenance": {"command": "hspec eval (test)", "date": "d", "commit": "c", "tree_dirty": False,
                           "machine": {}, "settings": {"K": K, "temperature": temperature, "tasks": "spec_bench",
                                                       "size_per_task": 8, "target": "tiny"}},
            "summary": {}, "records": records}


def _greedy_k7(items: int = 8) -> list[dict]:
    """hspec ahead of dspark on every item (tau and speed), behind dflash on every item, level with peagle
    (ahead on half the items, behind on the other half); the ablations as the paper has them."""
    records = []
    for i in range(items):
        wobble = i % 3  # items differ, so the CIs have width
        records.append(_record("none", i, [], decode_s=2.0))
        records.append(_record("hspec", i, [3, 2 + wobble, 4], decode_s=0.5))
        records.append(_record("dspark", i, [1, 1, 0, 2 + wobble], decode_s=0.8 + 0.1 * wobble))
        records.append(_record("dflash", i, [6, 5 + wobble, 7], decode_s=0.3))
        shift = -1 if i % 2 else 1  # pooled over the items, peagle emits exactly what hspec does
        records.append(_record("peagle", i, [3 + shift, 2 + wobble + shift, 4 + shift], decode_s=0.5))
        records.append(_record("hspec-nomarkov", i, [2, 1 + wobble, 3]))
        records.append(_record("mamba-only", i, [1, wobble, 1]))
    return records


def _write(folder: Path, stem: str, payload: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(payload))


def _claim(results, name: str):
    return next(r for r in results if r.claim.name == name)


def _comparison(result, behind: str, metric: str, K: int = 7, file: str = GREEDY_K7):
    return next(c for c in result.comparisons
                if (c.behind, c.metric, c.K, c.file) == (behind, metric, K, file))


def test_verdicts_follow_the_ci_and_a_contradiction_decides_the_claim():
    results = check_claims({GREEDY_K7: _payload(_greedy_k7())}, num_resamples=RESAMPLES)
    table2 = _claim(results, "table2")
    ahead = _comparison(table2, "dspark", TAU)
    # tau pooled over the items as a ratio of sums: tokens emitted / steps
    hspec_tokens = sum(12 + i % 3 for i in range(8))
    dspark_tokens = sum(4 + 4 + i % 3 for i in range(8))
    assert ahead.ci.estimate == pytest.approx((hspec_tokens / 24) / (dspark_tokens / 32) - 1)
    assert ahead.ci.low > 0 and ahead.verdict == "reproduced" and ahead.items == 8
    assert _comparison(table2, "dspark", SPEEDUP).verdict == "reproduced"  # hspec's ITL is lower
    behind = _comparison(table2, "dflash", TAU)
    assert behind.ci.high < 0 and behind.verdict == "contradicted"
    level = _comparison(table2, "peagle", TAU)
    assert level.ci.estimate == pytest.approx(0.0) and level.ci.low < 0 < level.ci.high
    assert level.verdict == "unresolved"
    assert table2.verdict == "contradicted"  # one comparison against the paper is enough
    # hspec-nomarkov ahead of mamba-only; attention-only, the claim's other pair, is not in the run
    assert _claim(results, "fig7b").verdict == "reproduced in part"
    assert _claim(results, "markov").verdict == "reproduced"  # hspec ahead of hspec-nomarkov


@pytest.mark.parametrize(("load", "used"), [(2.3, True), (3.4, False)])
def test_speeds_timed_on_a_shared_cpu_are_not_compared_and_tau_still_is(load, used):
    records = [{**r, "load_1min": load, "threads": 2} for r in _greedy_k7()]
    table2 = _claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES), "table2")
    assert _comparison(table2, "dspark", TAU).verdict == "reproduced"
    speed = [c for c in table2.comparisons if c.metric == SPEEDUP]
    assert bool(speed) == used
    if not used:
        assert any("timed on a shared CPU" in s and "1.4" in s for s in table2.skipped)


def test_all_reproduced_or_some_unresolved():
    records = [r for r in _greedy_k7() if r["method"] != "dflash"]
    results = check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES)
    assert _claim(results, "table2").verdict == "unresolved"  # dspark: reproduced, peagle: unresolved
    records = [r for r in records if r["method"] != "peagle"]
    table2 = _claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES), "table2")
    assert table2.verdict == "reproduced in part"  # two pairs of the claim were not compared
    assert table2.untested_pairs == (("hspec", "dflash"), ("hspec", "peagle"))
    for i in range(8):  # DFlash and P-Eagle as far behind as DSpark: every pair compared and reproduced
        for kind in ("dflash", "peagle"):
            records.append(_record(kind, i, [1, 1, 0, 2 + i % 3], decode_s=0.8 + 0.1 * (i % 3)))
    assert _claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES),
                  "table2").verdict == "reproduced"


def test_missing_files_and_drafters_are_skipped_with_their_reason():
    results = check_claims({GREEDY_K7: _payload(_greedy_k7())}, num_resamples=RESAMPLES)
    table3 = _claim(results, "table3")
    assert table3.verdict == "skipped" and table3.comparisons == ()
    assert table3.skipped == (f"{SAMPLED_K7}.json: not in the folder",)
    fig7a = _claim(results, "fig7a")
    assert fig7a.verdict == "skipped"
    assert any("hspec-lasttoken-only not in the run (it ran " in s for s in fig7a.skipped)
    fig4 = _claim(results, "fig4")
    assert any("dflash-kvreuse not in the run" in s for s in fig4.skipped)
    assert f"{TASKS_K7}.json: not in the folder" in _claim(results, "table2").skipped
    assert [r.claim.name for r in results] == [c.name for c in CLAIMS]  # every claim is reported


def test_table3_needs_a_sampled_run():
    greedy = check_claims({SAMPLED_K7: _payload(_greedy_k7(), temperature=0.0)}, num_resamples=RESAMPLES)
    assert _claim(greedy, "table3").verdict == "skipped"
    assert "temperature 0.0, but this claim needs a sampled run" in _claim(greedy, "table3").skipped[0]
    sampled = check_claims({SAMPLED_K7: _payload(_greedy_k7(), temperature=1.0)}, num_resamples=RESAMPLES)
    table3 = _claim(sampled, "table3")
    assert {c.metric for c in table3.comparisons} == {TAU}  # Table 3 is about tau only
    assert _comparison(table3, "dspark", TAU, file=SAMPLED_K7).verdict == "reproduced"


def test_k_sweep_is_tested_at_every_k():
    records = []
    for i in range(6):
        records.append(_record("none", i, [], K=3))
        for K in (3, 5):
            records.append(_record(f"hspec k={K}", i, [K, K - 1, i % 2], decode_s=0.5, K=K))
            records.append(_record(f"dspark k={K}", i, [0, 1, i % 2], decode_s=0.5, K=K))
    table4 = _claim(check_claims({K_SWEEP: _payload(records, K=[3, 5])}, num_resamples=RESAMPLES), "table4")
    assert sorted({(c.K, c.metric) for c in table4.comparisons}) == [(3, SPEEDUP), (3, TAU), (5, SPEEDUP),
                                                                     (5, TAU)]
    assert all(c.verdict == "reproduced" for c in table4.comparisons if c.metric == TAU)
    assert f"{K_SWEEP}.json K=5: hspec vs peagle: peagle not in the run (it ran dspark, hspec)" in table4.skipped


def test_the_turns_of_an_item_are_resampled_together():
    records = []
    for i in range(4):
        for turn in (0, 1):
            records.append(_record("hspec", i, [4, 4], turn=turn))
            records.append(_record("dflash", i, [0, 0] if turn else [3, 3], turn=turn))  # tau 1, then 4
    records.append(_record("hspec", 9, [1]))  # an item dflash did not run is left out of the pairing
    table2 = _claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES), "table2")
    tau = _comparison(table2, "dflash", TAU)
    assert tau.items == 4
    # each item pools to the same tau per drafter (turns do not), so resampling items cannot move it
    assert tau.ci.low == pytest.approx(5 / 2.5 - 1) and tau.ci.high == pytest.approx(5 / 2.5 - 1)


def test_position_counts_give_the_conditional_acceptance_of_metrics():
    units = [{"num_accepted": [0, 3, 7, 2], "num_drafted": [7, 3, 7, 7]}, {"num_accepted": [5, 1]}]
    counts = _item_position_counts(units, np.array([0, 0]), 7)  # (1 item, K, 2)
    merged = acceptance_stats([0, 3, 7, 2, 5, 1], 7, [7, 3, 7, 7, 7, 7])
    np.testing.assert_allclose(counts[0, :, 0] / counts[0, :, 1], merged.acceptance_by_position)
    assert counts[0, 3].tolist() == [2.0, 2.0]  # position 4: the step that stopped after 3 never tried it


def test_direct_kv_reuse_decaying_at_later_positions_reproduces_fig4():
    records = []
    for i in range(8):
        records.append(_record("dflash", i, [7, 5 + i % 3, 1]))
        records.append(_record("dflash-kvreuse", i, [2, 2, 1]))  # as good early, never past position 3
    fig4 = _claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES), "fig4")
    late = _comparison(fig4, "dflash-kvreuse", LATE_ACCEPTANCE)
    # positions 3..7: dflash's first step tries and accepts all 5; its second (m = 5, 6, 7 accepted) tries
    # 3..min(m + 1, 7) and accepts 3..m; its third never gets there. dflash-kvreuse tries position 3
    # twice an item and never accepts it.
    dflash_acc = sum(5 + 3 + i % 3 for i in range(8))
    dflash_tried = sum(5 + min(5, 4 + i % 3) for i in range(8))
    assert late.ci.estimate == pytest.approx(dflash_acc / dflash_tried - 0.0)
    assert late.verdict == "reproduced" and late.items == 8
    assert fig4.verdict == "reproduced in part"  # hspec-kvreuse-only is not in the run: not held against it
    # position by position only where both tried it in 2+ items: dflash-kvreuse never tried 4..7
    assert [(g.position, g.items) for g in late.by_position] == [(FIRST_LATE_POSITION, 8)]
    assert late.by_position[0].ci.estimate == pytest.approx(1.0)  # dflash accepts position 3 whenever tried


def test_kv_reuse_as_good_as_its_reference_is_unresolved_and_k_below_the_late_positions_is_skipped():
    records = []
    for i, steps in enumerate([[1, 4, 7], [0, 2, 5], [6, 3, 1], [7, 0, 2]]):
        for method in ("dflash", "dflash-kvreuse"):
            records.append(_record(method, i, steps))
    late = _comparison(_claim(check_claims({GREEDY_K7: _payload(records)}, num_resamples=RESAMPLES), "fig4"),
                       "dflash-kvreuse", LATE_ACCEPTANCE)
    assert late.verdict == "unresolved" and late.ci.estimate == pytest.approx(0.0)
    short = [r | {"K": 2, "num_accepted": [min(n, 2) for n in r["num_accepted"]]} for r in records]
    fig4 = _claim(check_claims({GREEDY_K7: _payload(short, K=2)}, num_resamples=RESAMPLES), "fig4")
    assert fig4.verdict == "skipped"
    assert any(f"K=2 has no block position >= {FIRST_LATE_POSITION}" in s for s in fig4.skipped)


def test_the_command_writes_claims_with_provenance(tmp_path, capsys):
    folder = tmp_path / "comparison"
    _write(folder, GREEDY_K7, _payload(_greedy_k7()))
    out = tmp_path / "out"
    assert cli.main(["claims", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "table2 (Table 2): contradicted" in printed and "table3 (Table 3): skipped" in printed
    payload = json.loads((out / "claims.json").read_text())
    assert payload["provenance"]["command"] == f"hspec claims {folder} --out {out}"
    assert payload["provenance"]["settings"]["folder"] == str(folder)
    assert set(payload["inputs"]) == {GREEDY_K7} and payload["inputs"][GREEDY_K7]["commit"] == "c"
    assert [c["verdict"] for c in payload["claims"] if c["name"] == "fig7b"] == ["reproduced in part"]
    markdown = (out / "claims.md").read_text()
    assert "- command: `hspec claims" in markdown and "| table2 | Table 2 |" in markdown
    assert f"- table3: {SAMPLED_K7}.json: not in the folder" in markdown
    assert not (folder / "claims.json").exists()  # --out given: the folder is left alone
    write_claims(folder, num_resamples=200)
    assert (folder / "claims.json").exists() and (folder / "claims.md").exists()  # default: into the folder


def test_a_folder_without_evaluations_is_an_error(tmp_path, capsys):
    assert cli.main(["claims", str(tmp_path / "nowhere")]) == 2
    assert f"results folder {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    assert cli.main(["claims", str(tmp_path)]) == 2
    assert f"{tmp_path} holds none of the evaluation files the claims read: {GREEDY_K7}.json" in \
        capsys.readouterr().err
    (tmp_path / f"{GREEDY_K7}.json").write_text("{}")
    with pytest.raises(ValueError, match="is not an `hspec eval` result"):
        load_evals(tmp_path)
