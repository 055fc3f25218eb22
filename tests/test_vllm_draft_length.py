"""How many drafts H-Spec's vLLM proposer gives each request (`DraftLength`); no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hspec.drafters.step_cost import StepCost
from hspec.integrations.vllm.adaptive import CALIBRATION_SAMPLES, AdaptiveLength, read_cost
from hspec.integrations.vllm.proposer import HF_BUDGET_KEY, HF_FLOOR_KEY, DraftLength, hspec_config


def _vllm_config(k: int, **overrides) -> SimpleNamespace:
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(hf_config=SimpleNamespace(**overrides)))


def test_without_settings_every_request_gets_k():
    length = DraftLength.of(_vllm_config(7))
    assert (length.budget, length.confidence_floor) == (None, None)
    assert [length.per_request(n) for n in (1, 8, 64)] == [7, 7, 7]
    drafts = [[1, 2, 3], [4, 5, 6]]
    assert length.trim(drafts, torch.zeros(2, 3)) is drafts


def test_a_budget_shrinks_the_drafts_as_the_batch_grows():
    length = DraftLength.of(_vllm_config(7, **{HF_BUDGET_KEY: 64}))
    assert [length.per_request(n) for n in (1, 9, 10, 16, 32, 64, 65, 200)] == [7, 7, 6, 4, 2, 1, 0, 0]


def test_the_floor_keeps_each_rows_sure_prefix_and_at_least_one_draft():
    length = DraftLength.of(_vllm_config(4, **{HF_FLOOR_KEY: 0.4}))
    confidence = torch.tensor([[0.9, 0.5, 0.3, 0.9],   # the third is unsure: keep 2
                               [0.1, 0.9, 0.9, 0.9],   # the first is unsure: keep 1 anyway
                               [0.4, 0.4, 0.4, 0.4]])  # all at the floor: keep all
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert length.trim(drafts, confidence) == [[1, 2], [5], [9, 10, 11, 12]]


@pytest.mark.parametrize("bad, match", [({HF_BUDGET_KEY: -1}, "hspec_draft_budget must be >= 0"),
                                        ({HF_FLOOR_KEY: 1.0}, r"hspec_confidence_floor must be in \[0, 1\)")])
def test_bad_settings_name_the_override_and_what_is_allowed(bad, match):
    with pytest.raises(ValueError, match=match):
        DraftLength.of(_vllm_config(7, **bad))


def test_hspec_config_puts_the_settings_into_hf_overrides():
    _, overrides = hspec_config(7, "/ckpt", draft_budget=64, confidence_floor=0.4)
    assert overrides == {"hspec_drafter": "/ckpt", HF_BUDGET_KEY: 64, HF_FLOOR_KEY: 0.4}
    assert hspec_config(None)[1] == {}


def test_auto_is_read_from_hf_overrides_and_refuses_the_other_settings():
    length = DraftLength.of(_vllm_config(7, hspec_draft_length="auto", hspec_step_cost="0.5,0.1,0,0.05"))
    assert length.adaptive and length.step_cost == StepCost(0.5, 0.1, 0.0, 0.05)
    with pytest.raises(ValueError, match="hspec_draft_length must be 'auto'"):
        DraftLength.of(_vllm_config(7, hspec_draft_length="7"))
    with pytest.raises(ValueError, match="takes no hspec_draft_budget"):
        DraftLength.of(_vllm_config(7, hspec_draft_length="auto", **{HF_BUDGET_KEY: 8}))
    with pytest.raises(ValueError, match="hspec_step_cost is read by"):
        DraftLength.of(_vllm_config(7, hspec_step_cost="0.5,0.1,0"))
    _, overrides = hspec_config(7, adaptive=True, step_cost="0.5,0.1,0")
    assert overrides == {"hspec_draft_length": "auto", "hspec_step_cost": "0.5,0.1,0"}


def _lone_step(adaptive: AdaptiveLength, given: int, kept: int | None, drafted: bool, rows: int | None = None) -> int:
    """One proposer call for a lone request "r" after a step that verified `given` drafts and kept `kept`."""
    adaptive.start_step(["r"], [given + 1 if rows is None else rows], [given], [kept])
    if not adaptive.wants_drafts("r", lone=True):
        adaptive.end_step(0, None)
        return 0
    n = adaptive.length("r", [0.9] * adaptive.K, 100, lone=True)
    adaptive.end_step(n, 0.001 if drafted else None)
    return n


def test_a_lone_request_calibrates_on_a_fixed_cycle_then_the_costs_are_cached(tmp_path):
    path = tmp_path / "cost.json"
    adaptive = AdaptiveLength(4, path)
    lengths, given = [], 0
    for _ in range(3 * CALIBRATION_SAMPLES + 3):
        given = _lone_step(adaptive, given, 0, drafted=True)
        lengths.append(given)
        if adaptive.cost is not None:
            break
    assert lengths[:6] == [0, 1, 4, 0, 1, 4]  # the cycle reads no timing
    assert adaptive.cost is not None and path.exists()
    assert read_cost(path) == adaptive.cost  # the next engine on this machine reads it back
    assert AdaptiveLength(4, path).cost == adaptive.cost


def test_prefills_and_batches_are_not_timed():
    adaptive = AdaptiveLength(4, None)
    _lone_step(adaptive, 0, 0, drafted=False)  # gives 0 drafts
    _lone_step(adaptive, 0, 0, drafted=True, rows=30)  # the step ran 30 rows (a prefill): not a decode
    assert adaptive.timer.steps == {}
    adaptive.start_step(["r", "s"], [2, 1], [1, 0], [0, 0])  # a batch of two: not one request's time
    assert adaptive.timer.steps == {}


def test_after_calibration_each_request_gets_the_cost_aware_length_and_backs_off():
    cheap = AdaptiveLength(4, None, cost=StepCost(draft=0.1, per_token=0.05, per_token_key=0.0))
    cheap.start_step(["r"], [1], [0], [0])
    assert cheap.wants_drafts("r", lone=True)
    assert cheap.length("r", [0.9, 0.9, 0.9, 0.9], 100, lone=True) == 4
    dear = AdaptiveLength(4, None, cost=StepCost(draft=2.0, per_token=1.0, per_token_key=0.0))
    dear.start_step(["r"], [1], [0], [0])
    assert dear.length("r", [0.2, 0.1, 0.1, 0.1], 100, lone=True) == 0  # drafting does not pay: back off
    dear.start_step(["r"], [1], [0], [0])
    assert not dear.wants_drafts("r", lone=True)  # skips the next step
    dear.start_step([], [], [], [])  # the request finished: its state goes
    assert dear.rows == {}
