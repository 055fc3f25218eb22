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
from hspec.drafters.early_stop import EarlyStopDrafter
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.spec import parse_drafter_spec
from hspec.sampling import SamplingParams
from hspec.serving.engine import Engine, Request

TEXTS = ["hello world, hello world", "abcabcabcabc", "the quick brown fox", "zz", "one two one two one two",
         "a much longer prompt that spans several blocks of the pool, a much longer prompt"]
K = 4


def _model(target, kind):
    """A drafter of a registered kind. Tree kinds get every weight perturbed: SpecBlock's zero-initialised
    shift would otherwise make the state it carries between steps (kept across preemption) do nothing."""
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


def _engine(target, drafter, num_blocks, block_size=8, max_running=64):
    stages = DecodeStages(target.model, drafter, K, target.tokenizer.eos_token_ids, target.tokenizer.decode)
    return Engine(stages, target.model.new_pool(num_blocks, block_size, drafter.num_drafter_layers), max_running)


# Model-free kinds run every schedule; each other registered kind (random weights here) runs the
# hardest one: requests joining mid-flight into a pool small enough to force preemption. Tree kinds
# (specblock) reserve node budget + 1 positions a step; behind the chain wrappers (specblock:0.1,
# specblock+ngram) specblock still carries its state between steps, which a recompute must get back.
_CASES = [(k, n, j) for k in ("none", "ngram") for n, j in ((400, 0), (400, 3), (24, 2))] + \
    [(k, 10, 2) for k in [*DRAFTERS.names(), "hspec+ngram", "hspec+ngram:0.1", "specblock:0.1", "specblock+ngram"]
     if k not in ("none", "ngram")]


@pytest.mark.parametrize("kind,num_blocks,join_every", _CASES)
def test_engine_equals_single_request_loop(tiny_target, kind, num_blocks, join_every):
    drafter = _drafter(tiny_target, kind)
    requests = _mixed_requests(tiny_target, stop_text="ab")
    if kind not in ("none", "ngram"):
        requests = requests[:5]
    expected = {r.request_id: _alone(tiny_target, drafter, r) for r in requests}
    engine = _engine(tiny_target, drafter, num_blocks)
    outputs, reasons = _run(engine, requests, join_every)
    for r in requests:
        assert (outputs[r.request_id], reasons[r.request_id]) == expected[r.request_id], r.request_id
    if num_blocks < 100:
        assert engine.num_preemptions > 0, "the small pool should have forced preemption"
    assert engine.pool.utilization() == 0.0 and engine.pool.sequence_ids() == []


def test_full_pool_queues_instead_of_failing(tiny_target):
    """A pool that holds about one request: the others wait (or are preempted) and all finish exactly."""
    drafter = _drafter(tiny_target, "ngram")
    requests = [Request(f"q{i}", tuple(tiny_target.tokenizer.encode_prompt(t)), 20) for i, t in enumerate(TEXTS[:4])]
    engine = _engine(tiny_target, drafter, num_blocks=7, block_size=8)  # 56 positions
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


def test_cancel_frees_blocks_and_sends_nothing_more(tiny_target):
    drafter = _drafter(tiny_target, "ngram")
    engine = _engine(tiny_target, drafter, num_blocks=100)
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
    engine = _engine(tiny_target, drafter, num_blocks=4, block_size=8)  # 32 positions
    with pytest.raises(ValueError, match="more than the pool's capacity of 32 tokens"):
        engine.add(Request("long", tuple(range(3, 23)), 20))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.add(Request("zero", (1, 5), 0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(Request("oov", (1, 10_000), 4))
    engine.add(Request("ok", (1, 5, 6), 8))
    with pytest.raises(ValueError, match="already live"):
        engine.add(Request("ok", (1, 5, 6), 8))


@pytest.fixture(scope="module")
def int8_target(tiny_dirs):
    from conftest import load_tiny

    return load_tiny(tiny_dirs["llama"], dtype="int8")


def test_an_int8_recompute_writes_the_kv_bits_the_sequence_had(int8_target):
    """An int8 prompt prefill multiplies dequantized weights (other bits than the int8 kernel); a recompute
    after preemption must prefill only the prompt that way and run the generated tokens as decoding did."""
    model = int8_target.model
    stages = DecodeStages(model, create_drafter("none", int8_target.config), 0, ())
    prompt = int8_target.tokenizer.encode_prompt(TEXTS[5])
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
def test_an_int8_engine_under_preemption_equals_the_single_request_loop(int8_target, kind):
    drafter = _drafter(int8_target, kind)
    requests = _mixed_requests(int8_target)[:5]
    expected = {r.request_id: _alone(int8_target, drafter, r) for r in requests}
    engine = _engine(int8_target, drafter, 10)
    outputs, reasons = _run(engine, requests, join_every=2)
    assert engine.num_preemptions > 0
    for r in requests:
        assert (outputs[r.request_id], reasons[r.request_id]) == expected[r.request_id], r.request_id
