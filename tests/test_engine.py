"""The continuous-batching engine against the single-request loop, for every registered drafter kind.

Golden test: a mixed batch (prompt lengths, limits, greedy and sampled rows, a stop string) run by
the engine, with requests joining while others decode and with a pool small enough to force
preemption, gives every request exactly the tokens `SpeculativeDecoder.generate` gives it alone.
"""

from __future__ import annotations

import pytest
import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.decoding.step import DecodeStages
from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.drafters.early_stop import EarlyStopDrafter
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.spec import parse_drafter_spec
from hspec.drafters.step_cost import StepCost
from hspec.sampling import SamplingBatch, SamplingParams, draw_uniforms, sample_with_uniform
from hspec.serving.engine import Engine, Request

TEXTS = ["hello world, hello world", "abcabcabcabc", "the quick brown fox", "zz", "one two one two one two",
         "a much longer prompt that spans several pages of the pool, a much longer prompt"]
K = 4


def _model(target, kind):
    """A drafter of a registered kind. Tree kinds get every weight perturbed: SpecBlock's zero-initialised
    shift would otherwise make the state it carries between steps (kept across preemption) do nothing. The
    weights are drawn from a fixed seed, so a test sees the same drafts whichever tests ran before it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        drafter = create_drafter(kind, target.config, target_model=target.model)
    if drafter.proposes_tree:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return drafter


def _drafter(target, kind):
    spec = parse_drafter_spec(kind)  # the grammar `hspec.runtime.build_drafter` reads
    # A confidence floor makes rows verify varying numbers of drafts (0.1: near the median confidence).
    if spec.confidence_floor is not None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = EarlyStopDrafter(_model(target, spec.base), spec.confidence_floor)
        if spec.lookup:
            return LookupFirstDrafter(model, target.config.vocab_size, min_match=2, trim_lookup=True)
        return model
    if spec.adaptive_length:  # rows verify 0..K drafts and back off (costs as in test_generate.py)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = _model(target, spec.base)
        if spec.lookup:
            model = LookupFirstDrafter(model, target.config.vocab_size, min_match=2)
        return CostAwareDrafter(model, target.config.vocab_size, StepCost(draft=0.02, per_token=0.05,
                                                                          per_token_key=0.0))
    if spec.lookup:  # prompt lookup in front of a trained kind
        return LookupFirstDrafter(_model(target, spec.base), target.config.vocab_size)
    return _model(target, kind)


def _mixed_requests(target, stop_text=None):
    """Requests of every flavour: greedy and sampled, short and long, one with a stop string."""
    requests = []
    for i, text in enumerate(TEXTS * 2):
        params = SamplingParams() if i % 3 else SamplingParams(temperature=0.9, top_p=0.95, top_k=20)
        stop = (stop_text,) if (stop_text and i == 4) else ()
        requests.append(Request(f"r{i}", tuple(target.tokenizer.encode_prompt(text)), 12 + 5 * (i % 5),
                                params, seed=100 + i, stop=stop))
    return requests


def _alone(target, drafter, request):
    decoder = SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids, target.tokenizer.decode)
    out = decoder.generate([list(request.prompt_ids)], request.sampling, request.max_tokens, stop=request.stop,
                           seeds=[request.seed]).sequences[0]
    return out.token_ids, out.finish_reason


def _run(engine, requests, join_every=0, max_steps=2000):
    """Step until every request finished; with join_every > 0, add one request every that many steps."""
    pending = list(requests)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while pending or engine.has_work:
        if pending and (join_every == 0 or steps % join_every == 0):
            for request in pending[: None if join_every == 0 else 1]:
                engine.add(request)
            pending = [] if join_every == 0 else pending[1:]
        report = engine.step()
        for update in report.updates:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                reasons[update.request_id] = update.finish_reason
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return outputs, reasons


def _engine(target, drafter, num_pages, page_size=8, max_running=64):
    stages = DecodeStages(target.model, drafter, K, target.tokenizer.eos_token_ids, target.tokenizer.decode)
    return Engine(stages, target.model.new_pool(num_pages, page_size, drafter.num_drafter_layers), max_running)


# Model-free kinds run every schedule; each other registered kind (random weights here) runs the
# hardest one: requests joining mid-flight into a pool small enough to force preemption. Tree kinds
# (specblock) reserve node budget + 1 positions a step; behind the chain wrappers (specblock:0.1,
# specblock+ngram) specblock still carries its state between steps, which a recompute must get back.
_CASES = [(k, n, j) for k in ("none", "ngram") for n, j in ((400, 0), (400, 3), (24, 2))] + \
    [(k, 10, 2) for k in [*DRAFTERS.names(), "hspec+ngram", "hspec+ngram:0.1", "specblock:0.1", "specblock+ngram",
                          "hspec:auto", "hspec+ngram:auto", "ngram:auto"]
     if k not in ("none", "ngram")]


@pytest.mark.parametrize("kind,num_pages,join_every", _CASES)
def test_engine_equals_single_request_loop(tiny_target, kind, num_pages, join_every):
    drafter = _drafter(tiny_target, kind)
    requests = _mixed_requests(tiny_target, stop_text="ab")
    if kind not in ("none", "ngram"):
        requests = requests[:5]
    expected = {r.request_id: _alone(tiny_target, drafter, r) for r in requests}
    engine = _engine(tiny_target, drafter, num_pages)
    outputs, reasons = _run(engine, requests, join_every)
    for r in requests:
        assert (outputs[r.request_id], reasons[r.request_id]) == expected[r.request_id], r.request_id
    if num_pages < 100:
        assert engine.num_preemptions > 0, "the small pool should have forced preemption"
    assert engine.pool.utilization() == 0.0 and engine.pool.sequence_ids() == []


def test_full_pool_queues_instead_of_failing(tiny_target):
    """A pool that holds about one request: the others wait (or are preempted) and all finish exactly."""
    drafter = _drafter(tiny_target, "ngram")
    requests = [Request(f"q{i}", tuple(tiny_target.tokenizer.encode_prompt(t)), 20) for i, t in enumerate(TEXTS[:4])]
    engine = _engine(tiny_target, drafter, num_pages=7, page_size=8)  # 56 positions
    for r in requests:
        engine.add(r)
    outputs: dict[str, list[int]] = {}
    max_waiting = 0
    while engine.has_work:
        report = engine.step()
        max_waiting = max(max_waiting, report.num_waiting)
        assert report.kv_usage <= 1.0
        for update in report.updates:
            assert update.finish_reason != "error", update.error
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert max_waiting >= 2
    assert all(outputs[r.request_id] == _alone(tiny_target, drafter, r)[0] for r in requests)


def test_cancel_frees_pages_and_sends_nothing_more(tiny_target):
    drafter = _drafter(tiny_target, "ngram")
    engine = _engine(tiny_target, drafter, num_pages=100)
    a, b = (Request(n, tuple(tiny_target.tokenizer.encode_prompt(t)), 40) for n, t in zip("ab", TEXTS))
    engine.add(a)
    engine.add(b)
    first = {u.request_id: list(u.new_token_ids) for u in engine.step().updates}
    assert engine.cancel("a") and not engine.cancel("a")
    outputs, _ = _run(engine, [])
    assert "a" not in outputs and engine.pool.utilization() == 0.0 and engine.pool.sequence_ids() == []
    assert first["b"] + outputs["b"] == _alone(tiny_target, drafter, b)[0]


def test_requests_that_can_never_run_are_refused(tiny_target):
    drafter = _drafter(tiny_target, "none")
    engine = _engine(tiny_target, drafter, num_pages=4, page_size=8)  # 32 positions
    with pytest.raises(ValueError, match="more than the pool's capacity of 32 tokens"):
        engine.add(Request("long", tuple(range(3, 23)), 20))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.add(Request("zero", (1, 5), 0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(Request("oov", (1, 10_000), 4))
    engine.add(Request("ok", (1, 5, 6), 8))
    with pytest.raises(ValueError, match="already live"):
        engine.add(Request("ok", (1, 5, 6), 8))


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_target(tiny_dirs, request):
    from conftest import load_tiny

    return load_tiny(tiny_dirs["llama"], dtype=request.param)


def test_a_quantized_recompute_writes_the_kv_bits_the_sequence_had(quantized_target):
    """An int8 or int4 prompt prefill multiplies dequantized weights (other bits than the kernel); a
    recompute after preemption must prefill only the prompt that way and run the generated tokens as
    decoding did."""
    model = quantized_target.model
    stages = DecodeStages(model, create_drafter("none", quantized_target.config), 0, ())
    prompt = quantized_target.tokenizer.encode_prompt(TEXTS[5])
    pool = model.new_pool(40, 8)
    logits = stages.prefill(pool, 0, prompt)
    generated = [int(logits.argmax())]
    for _ in range(6):
        generated.append(int(model(torch.tensor([generated[-1:]]), pool, [0]).logits[0, -1].argmax()))

    def kv():  # copies: the pool hands out views of slots a recompute writes again
        table = pool.slot_table([0])
        return [[t.clone() for t in pool.gather(layer, table)] for layer in range(model.config.num_layers)]

    before = kv()
    stages.release(pool, 0)
    history = prompt + generated
    stages.prefill(pool, 0, history[:-1], prompt_length=len(prompt))
    after = kv()
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    stages.release(pool, 0)
    stages.prefill(pool, 0, history[:-1])  # all of it as a prompt: the generated positions' bits differ
    whole = kv()
    assert not all(torch.equal(k0, k1) for (k0, _), (k1, _) in zip(before, whole, strict=True))
    with pytest.raises(ValueError, match="prompt_length must be in 1..6"):
        stages.prefill(pool, 1, history[:6], prompt_length=7)


@pytest.mark.parametrize("kind", ["ngram", "hspec"])
def test_a_quantized_engine_under_preemption_equals_the_single_request_loop(quantized_target, kind):
    drafter = _drafter(quantized_target, kind)
    requests = _mixed_requests(quantized_target)[:5]
    expected = {r.request_id: _alone(quantized_target, drafter, r) for r in requests}
    engine = _engine(quantized_target, drafter, 10)
    outputs, reasons = _run(engine, requests, join_every=2)
    assert engine.num_preemptions > 0
    for r in requests:
        assert (outputs[r.request_id], reasons[r.request_id]) == expected[r.request_id], r.request_id


# ---- speculate_max_batch: plain steps for large batches ------------------------------------------


@pytest.mark.parametrize("kind", [*(k for k in DRAFTERS.names() if k != "none"), "hspec+ngram:0.1"])
def test_above_speculate_max_batch_the_engine_steps_plain_and_greedy_output_is_unchanged(tiny_target, kind):
    """Requests join one every other step, so the batch crosses the limit both ways; a small pool adds
    preemption. Greedy output equals the request's output alone, and only the small batches speculated."""
    drafter = _drafter(tiny_target, kind)
    requests = [Request(r.request_id, r.prompt_ids, r.max_tokens, SamplingParams(), r.seed)
                for r in _mixed_requests(tiny_target)[:5]]
    expected = {r.request_id: _alone(tiny_target, drafter, r) for r in requests}
    stages = DecodeStages(tiny_target.model, drafter, K, tiny_target.tokenizer.eos_token_ids)
    engine = Engine(stages, tiny_target.model.new_pool(14, 8, drafter.num_drafter_layers), 64, speculate_max_batch=2)
    pending, outputs, batches = list(requests), {}, {"speculative": set(), "plain": set()}
    for step in range(2000):
        if pending and step % 2 == 0:
            engine.add(pending.pop(0))
        if not (pending or engine.has_work):
            break
        report = engine.step()
        if report.num_decoded:
            batches["speculative" if report.num_accepted else "plain"].add(report.num_decoded)
        for update in report.updates:
            assert update.finish_reason != "error", update.error
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert {r.request_id: outputs[r.request_id] for r in requests} == {k: v[0] for k, v in expected.items()}
    assert batches["speculative"] and max(batches["speculative"]) <= 2, batches
    assert batches["plain"] and min(batches["plain"]) > 2, batches
    assert engine.num_preemptions > 0 and engine.pool.utilization() == 0.0


@pytest.mark.parametrize("kind", ["hspec", "dflash", "dfly", "ngram"])
def test_a_plain_step_leaves_the_drafter_where_a_prefill_of_the_same_history_would(tiny_target, kind):
    """After plain steps the next proposal is the one a drafter freshly prefilled with that history makes:
    step_plain commits x0's hidden states (and a drafter's own K/V) as a speculative step does."""
    drafter = _drafter(tiny_target, kind)
    if isinstance(drafter, torch.nn.Module):  # perturbed: zero-initialised inputs would hide a stale state
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model = tiny_target.model
    stages = DecodeStages(model, drafter, K, ())
    greedy = SamplingParams()
    prompt = tiny_target.tokenizer.encode_prompt(TEXTS[2])
    pool = model.new_pool(40, 8, drafter.num_drafter_layers)
    history = prompt + [stages.first_token(stages.prefill(pool, 0, prompt), _batch(greedy), torch.Generator())]
    for _ in range(4):
        result = stages.step_plain(pool, [0], [history], _batch(greedy), [torch.Generator()])
        assert result.num_accepted == [0] and result.num_drafted == [0] and len(result.new_tokens[0]) == 1
        history += result.new_tokens[0]
    assert pool.length(0) == len(history) - 1  # x0 of the next step is not cached yet
    stages.prefill(pool, 1, history[:-1], prompt_length=len(prompt))

    def proposal(seq_id):
        anchors = torch.tensor([history[-1]])
        return drafter.propose(DraftBatch([seq_id], anchors, [history], pool, _batch(greedy), [torch.Generator()]), K)

    after_steps, after_prefill = proposal(0), proposal(1)
    assert torch.equal(after_steps.draft_tokens, after_prefill.draft_tokens)
    torch.testing.assert_close(after_steps.draft_probs, after_prefill.draft_probs)


def test_a_plain_step_samples_from_the_target_with_one_uniform_of_the_row(tiny_target):
    """A sampled row's token is the inverse-CDF draw of the target's (temperature, top-p, top-k) distribution
    at one uniform of the row's own generator, whatever the other rows are."""
    model = tiny_target.model
    drafter = _drafter(tiny_target, "hspec")
    stages = DecodeStages(model, drafter, K, ())
    prompts = [tiny_target.tokenizer.encode_prompt(t) for t in TEXTS[:3]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=20), SamplingParams(), SamplingParams(1.3)]
    sampling = SamplingBatch.from_params(params, "cpu")
    pool = model.new_pool(60, 8, drafter.num_drafter_layers)
    logits = torch.cat([stages.prefill(pool, i, p) for i, p in enumerate(prompts)])  # (3, V)
    generators = [torch.Generator().manual_seed(7 + i) for i in range(3)]
    uniforms = draw_uniforms([torch.Generator().manual_seed(7 + i) for i in range(3)], 1, "cpu")[:, 0]
    histories = [p + [int(token)] for p, token in zip(prompts, logits.argmax(-1))]
    reference_pool = model.new_pool(60, 8, drafter.num_drafter_layers)
    for i, p in enumerate(prompts):
        stages.prefill(reference_pool, i, p)
    target = model(torch.tensor([[h[-1]] for h in histories]), reference_pool, [0, 1, 2]).logits  # (3, 1, V)
    expected = sample_with_uniform(sampling.probs(target)[:, -1], uniforms)
    result = stages.step_plain(pool, [0, 1, 2], histories, sampling, generators)
    assert [t[0] for t in result.new_tokens] == expected.tolist()
    assert result.new_tokens[1] == [int(target[1, -1].argmax())]


def test_speculate_max_batch_must_not_be_negative(tiny_target):
    drafter = _drafter(tiny_target, "ngram")
    stages = DecodeStages(tiny_target.model, drafter, K, ())
    with pytest.raises(ValueError, match=r"speculate_max_batch must be >= 0 \(0: never speculate\).*got -1"):
        Engine(stages, tiny_target.model.new_pool(10, 8), 8, speculate_max_batch=-1)


def _batch(params):
    return SamplingBatch.from_params([params], "cpu")
