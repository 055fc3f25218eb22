"""`KIND:auto`: each row verifies the drafts that pay on this machine's costs, 0 included, and backs off
drafting where it does not pay (hspec.drafters.cost_aware). Losslessness of the whole loop is in
test_generate.py (greedy in every dtype, chi-square when sampling)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import pool_free_draft_batch
from hspec.decoding.step_cost import cached_step_cost
from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.cost_aware import Backoff, CostAwareDrafter, best_draft_length
from hspec.drafters.spec import DrafterSpec, parse_drafter_spec
from hspec.drafters.step_cost import StepCost, expected_emitted
from hspec.sampling import SamplingBatch, SamplingParams


class _ConfidentDrafter(Drafter):
    """Drafts token 9 everywhere with fixed confidences per sequence id; records the ids it drafted for."""

    kind = "confident-test"

    def __init__(self, vocab_size: int, confidence: dict[int, list[float]]) -> None:
        self.vocab_size, self.confidence, self.calls = vocab_size, confidence, []

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        self.calls.append(list(batch.seq_ids))
        tokens = torch.full((len(batch.seq_ids), K), 9, dtype=torch.long)
        probs = torch.zeros((len(batch.seq_ids), K, self.vocab_size)).scatter_(-1, tokens[..., None], 1.0)
        return Proposal(tokens, probs, confidence=torch.tensor([self.confidence[s][:K] for s in batch.seq_ids]))


class _Lengths:
    """The one pool query the cost-aware rule makes: each sequence's context length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def lengths(self, seq_ids):
        return [self.length] * len(seq_ids)


def _batch(rows: int, context: int = 100) -> DraftBatch:
    return replace(pool_free_draft_batch([[1, 2, 3]] * rows), pool=_Lengths(context))


def test_expected_emitted_and_cost_by_hand():
    assert expected_emitted([0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_emitted([]) == 1.0
    cost = StepCost(draft=0.5, per_token=0.1, per_token_key=1e-4)
    assert cost.of(3, 1000, 7) == pytest.approx(0.5 + 1 + 3 * 0.2)
    assert cost.of(0, 1000, 0) == 1.0  # the drafter did not run
    by_position = StepCost(draft=0.2, per_token=0.1, per_token_key=0.0, draft_per_position=0.05)
    assert by_position.of(2, 0, 3) == pytest.approx(0.2 + 3 * 0.05 + 1 + 2 * 0.1)  # 3 drafted, 2 verified
    with pytest.raises(ValueError, match="per_token must be a number >= 0"):
        StepCost(0.5, -0.1, 0.0)


def test_the_length_stops_at_the_first_draft_that_does_not_pay():
    cost = StepCost(draft=0.5, per_token=0.1, per_token_key=0.0)
    # rates: n=0 1/1.5; n=1 1.9/1.6 = 1.19; n=2 2.62/1.7 = 1.54; n=3 2.764/1.8 = 1.536: stop at 2, although
    # n=4 (a sure fourth draft after an unsure third) would beat n=3: a later draft never pulls earlier ones in.
    n, rate = best_draft_length([0.9, 0.8, 0.2, 0.99], 0, cost)
    assert (n, rate) == (2, pytest.approx(2.62 / 1.7))
    assert best_draft_length([0.05, 0.9], 0, cost)[0] == 0  # the first draft does not pay: a plain decode
    assert best_draft_length([0.99] * 7, 0, StepCost(0.0, 0.0, 0.0))[0] == 7  # free drafts: all of them


def test_a_first_draft_that_pays_only_with_the_ones_expected_after_it_is_taken():
    cost = StepCost(draft=0.5, per_token=0.1, per_token_key=0.0, first_token=0.3)
    assert cost.of(0, 0, 7) == pytest.approx(1.5) and cost.of(2, 0, 7) == pytest.approx(0.5 + 1 + 0.3 + 0.2)
    # n=0 1/1.5 = 0.667; n=1 (1 + 0.25) / 1.9 = 0.658 does not pay alone, but with the record expecting 0.9
    # after it n=4 (1 + 0.25 + 0.225 + 0.2025 + 0.182) / 2.2 = 0.845 does: the first draft goes in
    estimate = [0.25, 0.9, 0.9, 0.9]
    assert best_draft_length(estimate, 0, cost)[0] == 0  # without a record: only the first draft is judged
    assert best_draft_length(estimate, 0, cost, outlook=[0.5, 0.9, 0.9, 0.9])[0] == 4
    # a record that expects little after it: only what this step's drafts pay counts, as without one
    assert best_draft_length([0.2, 0.9], 0, cost, outlook=[0.2, 0.05])[0] == 0
    # whether draft 1 is verified reads estimate[0] and the record, never the later drafts' estimates
    for later in ([0.0, 0.0, 0.0], [0.99, 0.99, 0.99], [0.5, 0.1, 0.9]):
        n, _ = best_draft_length([0.25, *later], 0, cost, outlook=[0.5, 0.9, 0.9, 0.9])
        assert n >= 1
    assert StepCost.parse("0.6,0.13,8e-5,0.08") == StepCost(0.6, 0.13, 8e-5, 0.08)
    assert StepCost(0.6, 0.13, 8e-5, 0.08).to_dict()["first_token"] == 0.08


def test_a_longer_context_drafts_less():
    cost = StepCost(draft=0.3, per_token=0.05, per_token_key=1e-4)
    confidence = [0.8, 0.7, 0.6, 0.5, 0.4]
    short, _ = best_draft_length(confidence, 128, cost)
    long, _ = best_draft_length(confidence, 4096, cost)
    assert long < short


def test_rows_that_do_not_pay_back_off_and_the_drafter_skips_them():
    # seq 10 pays (sure drafts, cheap verify); seq 11 never does: it is probed after 1, 2, 4, 4, ... skipped steps
    # (no cold rule: the growing skips from its first probe)
    model = _ConfidentDrafter(16, {10: [0.9] * 4, 11: [0.01] * 4})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.2, per_token=0.05, per_token_key=0.0),
                               Backoff(first=1, growth=2, most=4, cold=0))
    batch = _batch(2)
    drafted = []
    for _ in range(14):
        proposal = drafter.propose(batch, K=4)
        drafted.append(proposal.num_drafts.tolist())
    assert [n for n, _ in drafted] == [4] * 14
    assert [n for _, n in drafted] == [0] * 14  # a probe of seq 11 verifies nothing either
    probes = [step for step, ids in enumerate(model.calls) if 11 in ids]
    assert probes == [0, 2, 5, 10]  # after each probe: skip 1, 2, 4, then 4 (most)
    assert drafter.kind == "confident-test:auto"


def _probes(drafter: CostAwareDrafter, model: _ConfidentDrafter, steps: int, start: int = 0) -> list[int]:
    """The steps start..start + steps - 1 at which the model drafted for sequence 10."""
    probed = []
    for step in range(start, start + steps):
        calls = len(model.calls)
        drafter.propose(_batch(1), K=4)
        if len(model.calls) > calls:
            probed.append(step)
    return probed


def test_by_default_a_row_whose_drafting_never_paid_probes_once_every_129_steps():
    model = _ConfidentDrafter(16, {10: [0.01] * 4})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.2, per_token=0.05, per_token_key=0.0))
    assert _probes(drafter, model, 300) == [0, 129, 258]
    assert not drafter._rows[10].paid


def test_by_default_a_row_whose_drafting_paid_once_skips_2_then_12_72_and_128_steps():
    model = _ConfidentDrafter(16, {10: [0.9] * 4})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.2, per_token=0.05, per_token_key=0.0))
    assert _probes(drafter, model, 3) == [0, 1, 2]  # sure drafts pay: the row drafts every step
    model.confidence[10] = [0.01] * 4  # from step 3 its drafts stop paying
    assert _probes(drafter, model, 250, start=3) == [3, 6, 19, 92, 221]
    state = drafter.carried_state(10)  # through a preemption the row keeps that its drafting once paid
    drafter.release(10)
    drafter.restore_carried_state(10, state)
    assert drafter._rows[10].paid


@pytest.mark.parametrize("first, growth, most, cold", [(0, 2, 8, 0), (4, 2, 2, 0), (1, 0, 8, 0), (1, 2, 8, -1)])
def test_a_backoff_that_cannot_work_is_refused_with_its_values(first, growth, most, cold):
    with pytest.raises(ValueError, match=f"first={first}, growth={growth}, most={most}, cold={cold}"):
        Backoff(first=first, growth=growth, most=most, cold=cold)


def test_a_batch_where_every_row_backs_off_runs_no_drafter():
    model = _ConfidentDrafter(16, {10: [0.01] * 3})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.5, per_token=0.1, per_token_key=0.0))
    batch = _batch(1)
    drafter.propose(batch, K=3)  # the probe
    proposal = drafter.propose(batch, K=3)
    assert len(model.calls) == 1
    assert proposal.num_drafts.tolist() == [0] and proposal.draft_probs.shape == (1, 3, 16)


def test_the_backoff_follows_a_row_through_a_preemption_and_is_forgotten_on_release():
    model = _ConfidentDrafter(16, {10: [0.01] * 3})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.5, per_token=0.1, per_token_key=0.0), Backoff(cold=0))
    batch = _batch(1)
    for _ in range(2):  # the probe, then the first of the 2 steps it skips
        drafter.propose(batch, K=3)
    state = drafter.carried_state(10)
    drafter.release(10)
    assert drafter.carried_state(10) is None
    drafter.restore_carried_state(10, state)
    calls = len(model.calls)
    drafter.propose(batch, K=3)  # the second step of the 2-step skip
    assert len(model.calls) == calls
    drafter.propose(batch, K=3)  # the probe after it
    assert len(model.calls) == calls + 1


class _Lookup(Drafter):
    """Drafts token 9 everywhere without a confidence, as prompt lookup and n-gram do."""

    kind = "lookup-test"

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        tokens = torch.full((len(batch.seq_ids), K), 9, dtype=torch.long)
        return Proposal(tokens, torch.zeros((len(batch.seq_ids), K, 16)).scatter_(-1, tokens[..., None], 1.0))


def test_drafts_without_a_confidence_are_judged_by_the_rows_record():
    drafter = CostAwareDrafter(_Lookup(), 16, StepCost(draft=0.0, per_token=0.3, per_token_key=0.0))
    batch = _batch(2)
    # a_k = 0.5 before any verdict: 1.5 / 1.3 > 1, 1.75 / 1.6 < 1.5 / 1.3: one draft each
    assert drafter.propose(batch, K=4).num_drafts.tolist() == [1, 1]
    drafter.commit(None, [10, 11], None, torch.tensor([2, 1]))  # seq 10 accepted its draft, seq 11 did not
    # bucket 0: a drafter that reports no match length; (1 + 2 x 0.5) / 3, then the prior
    assert drafter._rows[10].lookup[0].estimates(2) == pytest.approx([2 / 3, 2 / 3])
    assert drafter._rows[11].lookup[0].estimates(2) == pytest.approx([1 / 3, 1 / 3])
    lengths = []
    for _ in range(16):  # seq 10 keeps accepting whatever it verifies: it learns to verify more, position by position
        n = drafter.propose(batch, K=4).num_drafts.tolist()
        lengths.append(n[0])
        drafter.commit(None, [10, 11], None, torch.tensor([n[0] + 1, 1]))
    assert lengths == sorted(lengths) and lengths[-1] >= 3
    drafter.commit(None, [10, 11], None, torch.tensor([1, 1]))


def test_a_row_backing_off_the_model_still_drafts_by_lookup():
    """hspec+ngram:auto: the model never pays (a sure skip), yet a row whose history repeats drafts by lookup,
    free, while it backs off the model; lookup steps leave the back-off alone."""
    from hspec.drafters.lookup_first import LookupFirstDrafter

    model = _ConfidentDrafter(16, {10: [0.01] * 4})
    drafter = CostAwareDrafter(LookupFirstDrafter(model, 16), 16, StepCost(draft=0.5, per_token=0.05, per_token_key=0),
                               Backoff(cold=0))
    no_match, match = _batch(1), replace(_batch(1), tokens=[[5, 6, 7, 5]])
    drafter.propose(no_match, K=4)  # the model's probe: it does not pay, so the row skips the next 2 steps
    assert len(model.calls) == 1 and drafter._rows[10].skip == 2
    proposal = drafter.propose(match, K=4)  # backing off, but lookup drafts it for free
    assert len(model.calls) == 1 and proposal.num_drafts.tolist()[0] >= 1
    assert proposal.draft_tokens[0, :2].tolist() == [6, 7]
    drafter.propose(no_match, K=4)  # the second skipped step
    assert len(model.calls) == 1
    drafter.propose(no_match, K=4)  # the back-off was not reset by the lookup step: the model probes again
    assert len(model.calls) == 2 and drafter._rows[10].backoff == 12


def test_the_name_grammar_takes_auto():
    assert parse_drafter_spec("hspec:auto") == DrafterSpec("hspec", adaptive_length=True)
    assert parse_drafter_spec("hspec+ngram:auto") == DrafterSpec("hspec", lookup=True, adaptive_length=True)
    with pytest.raises(ValueError, match="'auto' for the cost-aware draft length"):
        parse_drafter_spec("hspec:fast")
    assert parse_drafter_spec("ngram:auto") == DrafterSpec("ngram", adaptive_length=True)
    with pytest.raises(ValueError, match="plain decoding drafts nothing"):
        parse_drafter_spec("none:auto")


def test_build_drafter_wraps_the_given_costs(tiny_target):
    from hspec.drafters.lookup_first import LookupFirstDrafter
    from hspec.runtime import build_drafter

    cost = StepCost(0.3, 0.05, 0.0)
    alone = build_drafter("hspec:auto", tiny_target, random_weights=True, step_cost=cost)
    assert isinstance(alone, CostAwareDrafter) and alone.cost == cost and alone.kind == "hspec:auto"
    behind = build_drafter("hspec+ngram:auto", tiny_target, random_weights=True, step_cost=cost)
    assert isinstance(behind, CostAwareDrafter) and behind.kind == "hspec+ngram:auto"
    assert isinstance(behind.model, LookupFirstDrafter) and not behind.model.trim_lookup
    assert build_drafter("ngram:auto", tiny_target, step_cost=cost).kind == "ngram:auto"


def test_costs_are_measured_once_and_read_back(tmp_path, tiny_target):
    from hspec.decoding.step_cost import measure_step_cost
    from hspec.drafters import create_drafter

    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    measured = []

    def measure():
        measured.append(measure_step_cost(tiny_target.model, drafter, 3, contexts=(16, 64), repeats=2))
        return measured[-1]

    first = cached_step_cost(tmp_path, ("tiny", "hspec", 3), measure)
    again = cached_step_cost(tmp_path, ("tiny", "hspec", 3), measure)
    assert len(measured) == 1 and again == first and first.draft > 0
    other = cached_step_cost(tmp_path, ("tiny", "hspec", 4), measure)  # another key: measured anew
    assert len(measured) == 2 and other == measured[1]


def test_sampled_confidence_does_not_depend_on_the_draft_itself(tiny_target):
    """The confidence at position k must be a function of d_1..d_{k-1} only (`Proposal.confidence`): two draws
    that differ at d_1 keep the same c_1. The drafted token's own probability would fail this."""
    from hspec.drafters import create_drafter

    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    logits = torch.zeros(1, 2, drafter.config.draft_vocab_size)
    logits[0, :, :3] = torch.tensor([2.0, 1.5, 1.0])  # three likely tokens at each position
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)])
    draws = []
    for seed in range(12):
        with torch.no_grad():
            tokens, _, confidence = drafter.sample_block(logits, torch.tensor([1]), sampling,
                                                         [torch.Generator().manual_seed(seed)])
            draws.append((int(tokens[0, 0]), float(confidence[0, 0])))
    assert len({d for d, _ in draws}) > 1, "the seeds never drew two different first drafts"
    assert len({c for _, c in draws}) == 1


def test_given_step_costs_are_parsed_and_bad_ones_named(capsys):
    from hspec.cli import main

    assert StepCost.parse("0.6,0.13,8e-5") == StepCost(0.6, 0.13, 8e-5)
    grows = StepCost.parse("0.6,0.13,8e-5,0.08,1e-4")  # the draft grows with the context too
    assert grows == StepCost(0.6, 0.13, 8e-5, 0.08, 1e-4)
    assert grows.of(0, 1000, 7) == pytest.approx(0.6 + 0.1 + 1.0) and grows.of(0, 1000, 0) == 1.0
    assert StepCost.parse("0.6,0.13,8e-5,0.08,1e-4,0.05").draft_per_position == 0.05  # and with the positions
    for bad in ("0.6,0.13", "a,b,c", "0.6,-1,0", "1,2,3,4,5,6,7"):
        with pytest.raises(ValueError, match="--step-cost|per_token must"):
            StepCost.parse(bad)
    assert main(["generate", "--prompt", "hi", "--drafter", "hspec:auto", "--step-cost", "1,2"]) == 2
    assert "--step-cost takes DRAFT,PER_TOKEN,PER_TOKEN_KEY" in capsys.readouterr().err


def test_a_confident_drafter_the_target_keeps_rejecting_stops_being_believed():
    """The confidence is scaled by the row's record: sure drafts (0.9) that are never accepted soon look like
    drafts that do not pay, and the row backs off; a row whose drafts are accepted keeps verifying them all."""
    model = _ConfidentDrafter(16, {10: [0.9] * 4, 11: [0.9] * 4})
    drafter = CostAwareDrafter(model, 16, StepCost(draft=0.3, per_token=0.1, per_token_key=0.0))
    batch = _batch(2)
    first = drafter.propose(batch, K=4).num_drafts.tolist()
    assert first == [4, 4]
    for _ in range(3):  # seq 10 accepts everything it verifies, seq 11 nothing
        n = drafter.propose(batch, K=4).num_drafts.tolist()
        drafter.commit(None, [10, 11], None, torch.tensor([n[0] + 1, 1]))
    assert drafter._rows[10].model.calibrated([0.9])[0] == pytest.approx(0.9 * (3 + 1) / (3 * 0.9 + 1))
    assert drafter._rows[11].model.calibrated([0.9, 0.9]) == pytest.approx([0.9 / 3.7, 0.9 / 3.7])  # k=2: k=1's
    assert drafter._rows[11].model.calibrated([0.9])[0] < 0.3
    last = drafter.propose(batch, K=4).num_drafts.tolist()
    assert last[0] == 4 and last[1] <= 1  # seq 11 backs off: drafting no longer pays a decode's worth
    assert drafter._rows[11].backoff > 0 and drafter._rows[10].backoff == 0


def test_the_cost_cycle_verifies_the_lengths_it_is_given_and_skips_the_drafter_on_plain_steps(tiny_target):
    """`measure_step_cost` times steps of a real decode whose draft lengths `FixedLengths` sets: a plain step
    must not run the drafter (else the draft would be charged to the decode it is divided by), and a drafted
    step must verify exactly its length."""
    from hspec.cache.paged_pool import pages_for
    from hspec.decoding.step import DecodeStages
    from hspec.decoding.step_cost import FixedLengths
    from hspec.drafters import create_drafter
    from hspec.drafters.wrapping import WrappingDrafter
    from hspec.sampling import SamplingBatch, SamplingParams

    class Counting(WrappingDrafter):
        def __init__(self, model):
            super().__init__(model)
            self.kind, self.calls = model.kind, 0

        def propose(self, batch, K):
            self.calls += 1
            self.asked = K
            return self.model.propose(batch, K)

    counting = Counting(create_drafter("hspec", tiny_target.config, target_model=tiny_target.model))
    fixed = FixedLengths(counting)
    stages = DecodeStages(tiny_target.model, fixed, 3, eos_token_ids=())
    pool = tiny_target.model.new_pool(pages_for(64, 16), 16, counting.num_drafter_layers)
    history = [5, 6, 7, 8]
    stages.prefill(pool, 0, history[:-1])
    sampling = SamplingBatch.from_params([SamplingParams()])
    seen = []
    with torch.inference_mode():
        for positions, length in ((None, None), (None, 0), (None, 1), (None, 3), (1, 0), (2, 1), (None, None)):
            before, counting.asked = counting.calls, None
            fixed.positions, fixed.length = positions, length
            result = stages.step(pool, [0], [history], sampling, [torch.Generator().manual_seed(0)])
            history.extend(result.new_tokens[0])
            seen.append((result.num_drafted[0], counting.calls - before, counting.asked))
    stages.release(pool, 0)
    assert seen == [(0, 0, None), (0, 1, 3), (1, 1, 3), (3, 1, 3), (0, 1, 1), (1, 1, 2), (0, 0, None)]


def test_the_cost_cycle_verifies_its_length_where_the_drafter_would_verify_fewer(tiny_target):
    """A drafter may ask to verify fewer than K drafts (`:P`, a trimmed lookup row, none at all); the cycle's step
    must still verify its length, or the verify's costs would be timed on shorter blocks."""
    from hspec.cache.paged_pool import pages_for
    from hspec.decoding.step import DecodeStages
    from hspec.decoding.step_cost import FixedLengths
    from hspec.drafters import create_drafter
    from hspec.drafters.wrapping import WrappingDrafter
    from hspec.sampling import SamplingBatch, SamplingParams

    class VerifiesNothing(WrappingDrafter):
        def __init__(self, model):
            super().__init__(model)
            self.kind = model.kind

        def propose(self, batch, K):
            proposal = self.model.propose(batch, K)
            none = torch.zeros(len(batch.seq_ids), dtype=torch.long)  # (B,)
            return Proposal(proposal.draft_tokens, proposal.draft_probs, none)

    fixed = FixedLengths(VerifiesNothing(create_drafter("ngram", tiny_target.config)))
    pool = tiny_target.model.new_pool(pages_for(64, 16), 16, 0)
    stages = DecodeStages(tiny_target.model, fixed, 3, eos_token_ids=())
    history = [5, 6, 7, 8]
    stages.prefill(pool, 0, history[:-1])
    fixed.length = 3
    with torch.inference_mode():
        result = stages.step(pool, [0], [history], SamplingBatch.from_params([SamplingParams()]),
                             [torch.Generator().manual_seed(0)])
    assert result.num_drafted == [3]


def test_costs_behind_prompt_lookup_are_the_models(tmp_path, monkeypatch, tiny_target):
    """`hspec+ngram:auto` charges its model's rows the model's draft: the costs are measured on the model alone
    (a decode whose lookup kept matching would time no draft), so they are `hspec:auto`'s, one file for both."""
    from hspec.runtime import build_drafter, step_cost_of

    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))
    alone = build_drafter("hspec", tiny_target, random_weights=True)
    behind = build_drafter("hspec+ngram", tiny_target, random_weights=True)
    first = step_cost_of(behind, tiny_target, K=3)
    assert len(list((tmp_path / "step_costs").glob("*.json"))) == 1 and first.draft > 0
    assert step_cost_of(alone, tiny_target, K=3) == first
    assert len(list((tmp_path / "step_costs").glob("*.json"))) == 1


def test_measuring_costs_refuses_what_it_cannot_fit(tiny_target):
    from hspec.decoding.step_cost import measure_step_cost
    from hspec.drafters import create_drafter

    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    with pytest.raises(ValueError, match=r"0 < short < long, got \(64, 16\)"):
        measure_step_cost(tiny_target.model, drafter, 3, contexts=(64, 16))
    with pytest.raises(ValueError, match="K must be >= 1"):
        measure_step_cost(tiny_target.model, drafter, 0)
    with pytest.raises(ValueError, match="repeats must be >= 1 timed cycle, got 0"):
        measure_step_cost(tiny_target.model, drafter, 3, repeats=0)


class _LookupAfterMatch(Drafter):
    """Drafts token 9 everywhere without a confidence, reporting a match of `length` tokens, as prompt lookup does."""

    kind = "lookup-match-test"

    def __init__(self) -> None:
        self.length = 1

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        B = len(batch.seq_ids)
        return Proposal(torch.full((B, K), 9, dtype=torch.long), None,
                        match_length=torch.full((B,), self.length, dtype=torch.long))


def test_lookup_drafts_are_judged_by_a_record_per_match_length():
    """A row whose lookups after 1-token matches are always rejected and after 3-token ones always accepted
    verifies nothing after the first and more and more after the second: one record for both would verify
    the same after either."""
    lookup = _LookupAfterMatch()
    drafter = CostAwareDrafter(lookup, 16, StepCost(draft=0.0, per_token=0.3, per_token_key=0.0))
    batch = _batch(1)
    after = {1: [], 3: []}
    for step in range(24):
        lookup.length = 1 if step % 2 == 0 else 3
        n = drafter.propose(batch, K=4).num_drafts.tolist()[0]
        after[lookup.length].append(n)
        accepted = 0 if lookup.length == 1 else n
        drafter.commit(None, [10], None, torch.tensor([accepted + 1]))
    assert after[1][-1] == 0 and after[3][-1] == 4
    assert sorted(drafter._rows[10].lookup) == [1, 3]
    lookup.length = 5  # matches of 3 or more tokens share a record
    assert drafter.propose(batch, K=4).num_drafts.tolist() == [4]
