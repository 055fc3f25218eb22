"""Prompt lookup in front of a trained drafter (`KIND+ngram`): which rows look up, and what reaches
the verifier. Losslessness of the composite is in test_generate (it is one of ALL_KINDS there)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import pool_free_draft_batch
from hspec.drafters import DraftBatch, Drafter, Proposal, create_drafter
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.ngram.suffix import SuffixMatcher, longest_suffix_match


def _brute_force_match(history, max_ngram):
    """(length, end) of the longest suffix (<= max_ngram) recurring earlier, most recent on ties."""
    best = None
    for end in range(len(history) - 2, -1, -1):
        length = 0
        while (length < max_ngram and end - length >= 0
               and history[end - length] == history[len(history) - 1 - length]):
            length += 1
        if length and (best is None or length > best[0]):
            best = (length, end)
    return best


def test_longest_suffix_match_equals_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        history = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(1, 30))]
        max_ngram = rng.randint(1, 6)
        match = longest_suffix_match(history, max_ngram)
        expected = _brute_force_match(history, max_ngram)
        assert (None if match is None else (match.length, match.end)) == expected, (history, max_ngram)


def test_the_suffix_matcher_follows_growing_histories_as_a_fresh_search_does():
    rng = random.Random(1)
    for max_ngram in (1, 2, 3, 8):
        matcher = SuffixMatcher(max_ngram)
        histories = {seq_id: [] for seq_id in range(3)}
        for step in range(400):
            seq_id = rng.randrange(3)
            history = histories[seq_id]
            if step % 97 == 96:  # a sequence id taken over by another history, or by a cut copy of its own
                history = histories[seq_id] = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
            elif step % 61 == 60:
                history = histories[seq_id] = history[:rng.randrange(len(history) + 1)]
            history += [rng.randrange(rng.choice((2, 4, 9))) for _ in range(rng.randint(1, 8))]
            for _ in range(2):  # asked twice a step, as lookup_matches and propose do
                match = matcher.match(seq_id, history)
                expected = longest_suffix_match(history, max_ngram)
                assert match == expected, (history, max_ngram)
            if step % 50 == 49:
                matcher.release(seq_id)


def test_ngram_continues_its_match_padded_with_the_last_token_and_drafts_nothing_without_one(tiny_target):
    ngram = create_drafter("ngram", tiny_target.config)  # max_ngram 3
    history = [5, 6, 7, 1, 5, 6]
    proposal = ngram.propose(pool_free_draft_batch([history, [1, 2, 3]]), 6)
    assert proposal.draft_tokens.tolist() == [[7, 1, 5, 6, 6, 6], [3] * 6]
    assert proposal.num_drafts.tolist() == [6, 0]  # "3" never occurred before: a plain decode step
    assert proposal.match_length.tolist() == [2, 0]
    strict = create_drafter("ngram", tiny_target.config, max_ngram=3, min_ngram=3)
    assert strict.propose(pool_free_draft_batch([history]), 2).num_drafts.tolist() == [0]  # "5 6" is only 2 long


class _CountingDrafter(Drafter):
    """Drafts token 9 everywhere (probability 1) and records the rows it was asked for."""

    kind = "counting-test"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.calls = vocab_size, []

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        self.calls.append(list(batch.seq_ids))
        tokens = torch.full((len(batch.seq_ids), K), 9, dtype=torch.long)
        probs = torch.zeros((len(batch.seq_ids), K, self.vocab_size)).scatter_(-1, tokens[..., None], 1.0)
        return Proposal(tokens, probs)


def test_rows_with_a_long_enough_match_look_up_the_others_go_to_the_model():
    model = _CountingDrafter(vocab_size=16)
    drafter = LookupFirstDrafter(model, vocab_size=16, min_match=3)
    histories = [[1, 2, 3, 4, 1, 2, 3], [1, 2, 3, 4, 5, 2, 3], [4, 4, 4, 4]]  # match lengths 3, 2, 3
    proposal = drafter.propose(pool_free_draft_batch(histories), K=3)
    assert model.calls == [[11]]  # only the row whose match is too short
    assert proposal.draft_tokens.tolist() == [[4, 1, 2], [9, 9, 9], [4, 4, 4]]
    assert torch.equal(proposal.draft_probs.argmax(-1), proposal.draft_tokens)
    assert torch.equal(proposal.draft_probs.sum(-1), torch.ones(3, 3))
    assert drafter.lookup_share() == pytest.approx(2 / 3)


def test_the_model_does_not_run_when_every_row_looks_up():
    model = _CountingDrafter(vocab_size=16)
    drafter = LookupFirstDrafter(model, vocab_size=16, min_match=2)
    proposal = drafter.propose(pool_free_draft_batch([[7, 8, 7, 8], [3, 5, 3, 5, 3]]), K=2)
    assert model.calls == []
    assert proposal.draft_tokens.tolist() == [[7, 8], [5, 3]]


def test_propose_after_lookup_matches_drafts_what_propose_alone_drafts_and_searches_a_grown_history_again():
    model = _CountingDrafter(vocab_size=16)
    drafter = LookupFirstDrafter(model, vocab_size=16, min_match=1)
    history = [1, 2, 3, 1, 2]
    batch = pool_free_draft_batch([history])
    alone = drafter.propose(batch, K=3).draft_tokens.tolist()
    assert drafter.lookup_matches(batch) == [2]
    assert drafter.propose(batch, K=3).draft_tokens.tolist() == alone == [[3, 1, 2]]
    assert drafter.lookup_matches(batch) == [2]
    history.append(3)  # the step after: the match lookup_matches found for the shorter history is not taken
    assert drafter.propose(batch, K=3).draft_tokens.tolist() == [[1, 2, 3]]


def test_bad_settings_name_the_value(tiny_target):
    model = _CountingDrafter(vocab_size=16)
    with pytest.raises(ValueError, match="min_match 0"):
        LookupFirstDrafter(model, vocab_size=16, min_match=0)
    with pytest.raises(ValueError, match="drafts nothing"):
        LookupFirstDrafter(create_drafter("none", tiny_target.config), vocab_size=16)


def test_build_drafter_names_the_composite(tiny_target):
    from hspec.runtime import build_drafter

    drafter = build_drafter("hspec+ngram", tiny_target, random_weights=True)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.kind == "hspec+ngram"
    assert drafter.target_layers == drafter.model.target_layers
    with pytest.raises(ValueError, match="trained drafter kind"):
        build_drafter("ngram+ngram", tiny_target)
