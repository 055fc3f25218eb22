"""How many drafts H-Spec's vLLM proposer gives each request (`DraftLength`); no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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
