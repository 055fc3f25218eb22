"""`KIND:P`: rows verify only their leading drafts of confidence >= P (and behind lookup, 2m+1 drafts)."""

from __future__ import annotations

import pytest
import torch

from conftest import pool_free_draft_batch
from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.early_stop import EarlyStopDrafter, leading_confident
from hspec.drafters.lookup_first import LookupFirstDrafter


class _ConfidentDrafter(Drafter):
    """Drafts token 9 everywhere with fixed per-row confidences."""

    kind = "confident-test"

    def __init__(self, vocab_size: int, confidence: list[list[float]]) -> None:
        self.vocab_size, self.confidence, self.calls = vocab_size, torch.tensor(confidence), []

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        rows = [s - 10 for s in batch.seq_ids]
        self.calls.append(rows)
        tokens = torch.full((len(rows), K), 9, dtype=torch.long)
        probs = torch.zeros((len(rows), K, self.vocab_size)).scatter_(-1, tokens[..., None], 1.0)
        return Proposal(tokens, probs, confidence=self.confidence[rows, :K])


def test_leading_confident_counts_the_sure_prefix_and_never_less_than_one():
    confidence = torch.tensor([[0.9, 0.8, 0.1, 0.9], [0.2, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]])
    assert leading_confident(confidence, 0.5).tolist() == [2, 1, 4]
    assert leading_confident(confidence, 0.95).tolist() == [1, 1, 1]


def test_early_stop_cuts_each_row_after_its_confident_drafts():
    model = _ConfidentDrafter(16, [[0.9, 0.3, 0.9], [0.6, 0.7, 0.8]])
    proposal = EarlyStopDrafter(model, 0.5).propose(pool_free_draft_batch([[1, 2], [3, 4]]), K=3)
    assert proposal.num_drafts.tolist() == [1, 3]
    assert proposal.draft_tokens.shape == (2, 3)  # the drafts stay; only how many are verified changes


def test_lookup_rows_verify_2m_plus_1_drafts_and_model_rows_their_own_count():
    model = _ConfidentDrafter(16, [[0.9] * 7, [0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9], [0.9] * 7])
    drafter = LookupFirstDrafter(EarlyStopDrafter(model, 0.5), 16, trim_lookup=True)
    # row 0: 1-token match -> 3 drafts; row 1: no match -> the model stops after 2; row 2: 2-token match -> 5
    histories = [[5, 6, 7, 8, 5], [1, 2, 3], [4, 1, 2, 3, 1, 2, 6, 1, 2]]
    proposal = drafter.propose(pool_free_draft_batch(histories), K=7)
    assert model.calls == [[1]]
    assert proposal.num_drafts.tolist() == [3, 2, 5]
    assert proposal.draft_tokens[0, :3].tolist() == [6, 7, 8]
    assert drafter.kind == "confident-test+ngram:0.5"


def test_without_trimming_lookup_rows_verify_k():
    model = _ConfidentDrafter(16, [[0.9] * 4, [0.1] * 4])
    proposal = LookupFirstDrafter(model, 16).propose(pool_free_draft_batch([[5, 6, 7, 5], [1, 2]]), K=4)
    assert proposal.num_drafts is None


def test_bad_settings_name_the_value(tiny_target):
    from hspec.runtime import build_drafter

    with pytest.raises(ValueError, match="in \\(0, 1\\), got 1.5"):
        EarlyStopDrafter(_ConfidentDrafter(16, [[0.5]]), 1.5)
    with pytest.raises(ValueError, match="drafts nothing"):
        EarlyStopDrafter(create_drafter("none", tiny_target.config), 0.5)
    for bad in ("hspec:1", "hspec:x", "hspec+ngram:0"):
        with pytest.raises(ValueError, match="a number in \\(0, 1\\)"):
            build_drafter(bad, tiny_target, random_weights=True)
    with pytest.raises(ValueError, match="only trained drafters"):
        build_drafter("ngram:0.5", tiny_target)
    with pytest.raises(ValueError, match="no draft confidence"):
        EarlyStopDrafter(create_drafter("ngram", tiny_target.config), 0.5).propose(pool_free_draft_batch([[1, 2]]), 2)


def test_build_drafter_names_the_early_stop_forms(tiny_target):
    from hspec.runtime import build_drafter

    alone = build_drafter("hspec:0.4", tiny_target, random_weights=True)
    assert isinstance(alone, EarlyStopDrafter) and alone.kind == "hspec:0.4" and alone.floor == 0.4
    behind = build_drafter("hspec+ngram:0.4", tiny_target, random_weights=True)
    assert isinstance(behind, LookupFirstDrafter) and behind.trim_lookup and behind.kind == "hspec+ngram:0.4"
    assert isinstance(behind.model, EarlyStopDrafter)
