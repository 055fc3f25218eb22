"""The native proposal with its context read from the pool in place (`NativePropose.propose_in_pool`, what
`propose` runs for one greedy sequence whose context window lies in consecutive slots) against the same call
handed `block_context`: the same drafts, confidences and backbone logits bit for bit, for H-Spec and the DFlash
family in each dtype, with the drafter's sliding window shorter and longer than the context; the call's RoPE
against the target's; the pool's window against `gather_window`'s; and proposals whose drafts are deterministic
(greedy, prompt lookup) hand the verifier their tokens alone (`Proposal.draft_probs` None), which decodes,
greedy and sampled, exactly as the same proposals with their one-hot distributions built.
"""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import create_drafter, drafter_config
from hspec.drafters.base import DraftBatch, Proposal, one_hot_probs
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.wrapping import WrappingDrafter
from hspec.runtime import prepare_for_inference
from hspec.sampling import SamplingBatch, SamplingParams

K = 7
# (target dtype, drafter precision, kind): H-Spec's floating, int8 and w4a8 weights, and the DFlash family's
# attention over its own context K/V (dflash, dspark) or the target's (dflash-kvreuse).
SETTINGS = [("float32", "floating", "hspec"), ("bfloat16", "int8", "hspec"), ("w4a8", "auto", "hspec"),
            ("w4a8", "w4a8", "hspec"), ("bfloat16", "int8", "dflash"), ("w4a8", "auto", "dspark"),
            ("bfloat16", "auto", "dflash-kvreuse")]
# The drafter's sliding window; the contexts below run from inside it to well past it, and past the call's table
# of RoPE rows (256 positions from where it was made) and back.
WINDOW = 24
LENGTHS = (1, 5, 17, 24, 40, 100, 300, 40)


def _drafter(target, precision, kind, window=WINDOW):
    torch.manual_seed(0)
    config = drafter_config(kind, target.config, sliding_window=window)
    drafter = create_drafter(kind, target.config, target_model=target.model, config=config)
    if drafter.markov is not None:
        with torch.no_grad():
            drafter.markov.W2.normal_(std=0.5)
    drafter = prepare_for_inference(drafter, target.model.dtype_name, "cpu", precision=precision)
    if drafter.native_greedy is None or not drafter.native_greedy.reads_in_place:
        pytest.skip("hspec's CPU kernels do not run here: the native call does not read the pool in place")
    return drafter


def _batches(target, drafter, lengths, seed=1):
    """Per length n: a pool holding one prefilled sequence of n random tokens and the greedy DraftBatch of its
    next proposal (the drafter has committed the prefill)."""
    g = torch.Generator().manual_seed(seed)
    for n in lengths:
        pool = target.model.new_pool(2 * (n // 8 + 2), 8, drafter.num_drafter_layers)
        pool.add_sequence(0)
        ids = torch.randint(3, target.config.vocab_size, (1, n), generator=g)
        with torch.no_grad():
            out = target.model.prefill(ids, pool, [0], hidden_layers=drafter.target_layers)
        drafter.commit(pool, [0], out.hidden, torch.tensor([n]))
        yield DraftBatch([0], ids[:, -1], [ids[0].tolist()], pool, SamplingBatch.from_params([SamplingParams()]),
                         [torch.Generator()])
        drafter.release(0)


@pytest.mark.parametrize("dtype,precision,kind", SETTINGS)
def test_in_place_equals_the_call_handed_block_context(tiny_dirs, native_propose_extension, dtype, precision, kind):
    target = load_tiny(tiny_dirs["llama"], dtype=dtype)
    drafter = _drafter(target, precision, kind)
    native = drafter.native_greedy
    drafts = set()
    with torch.inference_mode():
        for batch in _batches(target, drafter, LENGTHS):
            in_place = native.propose_in_pool(batch.anchor_tokens, K, drafter.last_hidden_of([0])[0], batch.pool, 0,
                                              drafter.context_pool_layers(batch.pool), WINDOW)
            assert in_place is not None, "a lone prefilled sequence's pages are consecutive"
            handed = native.propose(drafter.block_context(batch, K, as_stored=True), batch.anchor_tokens)
            for name in ("drafts", "local", "confidence", "logits"):
                assert torch.equal(getattr(in_place, name), getattr(handed, name)), name
            assert torch.equal(in_place.drafts, drafter.head.to_target_ids(in_place.local))
            proposal = drafter.propose(batch, K)  # the path `propose` takes
            assert torch.equal(proposal.draft_tokens, in_place.drafts) and proposal.draft_probs is None
            drafts.add(tuple(in_place.local[0].tolist()))
    assert len(drafts) > 1, "every context drafted the same block"


def test_a_window_past_the_context_reads_other_keys(tiny_dirs, native_propose_extension):
    """The comparison above would catch a call that read the wrong slots: the same contexts under a window that
    reaches back to the first position give other logits once the context is longer than WINDOW."""
    target = load_tiny(tiny_dirs["llama"], dtype="bfloat16")
    short, full = _drafter(target, "int8", "hspec"), _drafter(target, "int8", "hspec", window=2048)
    with torch.inference_mode():
        for batch in _batches(target, short, (40,)):
            full.commit(batch.pool, [0], short.last_hidden_of([0])[:, None], torch.tensor([1]))  # the same state
            logits = [d.native_drafts(d.native_greedy, batch, K).logits for d in (short, full)]
            full.release(0)
    assert not torch.equal(*logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_calls_rope_is_the_targets(tiny_dirs, native_propose_extension, dtype):
    """Every block's rows of the call's RoPE table (256 positions from `start`) are the target's RoPE of that
    block alone, bit for bit."""
    target = load_tiny(tiny_dirs["llama"])
    for start in (0, 1, 37, 1000, 123457):
        inv_freq = target.model.inv_freq.float()
        cos, sin = native_propose_extension.rope_cos_sin(inv_freq, start, 256, dtype)  # (1, 256, D)
        for offset in (0, 1, 100, 249):
            positions = torch.arange(start + offset, start + offset + K)[None]  # (1, K)
            expected_cos, expected_sin = target.model.rope(positions, dtype)
            assert torch.equal(cos[:, offset:offset + K], expected_cos)
            assert torch.equal(sin[:, offset:offset + K], expected_sin)


def test_the_pools_consecutive_window_holds_gather_windows_keys(tiny_dirs):
    target = load_tiny(tiny_dirs["llama"])
    pool = target.model.new_pool(16, 8)
    pool.add_sequence(0)
    assert pool.consecutive_window(0, WINDOW) is None  # no keys yet
    pool.extend([0], 37)
    pool.k.normal_()
    for window in (5, 16, 37, 100):
        start, keys = pool.consecutive_window(0, window)
        assert keys == min(37, window)
        kv, visible = pool.gather_window([1], [0], [37], window, as_stored=True)
        assert bool(visible[0, :keys].all())
        assert torch.equal(pool.layer(1).k[start:start + keys], kv[0][0][0, :keys])
    pool._page_tables[0][1], pool._page_tables[0][2] = pool._page_tables[0][2], pool._page_tables[0][1]
    assert pool.consecutive_window(0, 37) is None
    assert pool.consecutive_window(0, 37 - 24) is not None  # positions 24..36: pages 3 and 4, still consecutive


class _OneHotBuilt(WrappingDrafter):
    """`model`'s proposals with their distributions always built (`Proposal.probs`), as before they could be
    left out."""

    def __init__(self, model, vocab_size: int) -> None:
        super().__init__(model)
        self.vocab_size, self.kind = vocab_size, model.kind

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        p = self.model.propose(batch, K)
        return Proposal(p.draft_tokens, p.probs(self.vocab_size), p.num_drafts, p.confidence)


@pytest.mark.parametrize("kind", ["ngram", "hspec", "hspec+ngram"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95)])
def test_proposals_without_their_one_hots_decode_as_with_them(tiny_target, kind, params):
    def make():
        torch.manual_seed(0)
        model = create_drafter(kind.removesuffix("+ngram"), tiny_target.config, target_model=tiny_target.model)
        return LookupFirstDrafter(model, tiny_target.config.vocab_size, min_match=2) if "+" in kind else model

    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in ("abcabcabc abc", "the quick brown fox", "x")]
    outputs = []
    for drafter in (make(), _OneHotBuilt(make(), tiny_target.config.vocab_size)):
        decoder = SpeculativeDecoder(tiny_target.model, drafter, 4, tiny_target.tokenizer.eos_token_ids)
        outputs.append([s.token_ids for s in decoder.generate(prompts, params, 24, seeds=[3, 4, 5]).sequences])
    assert outputs[0] == outputs[1]


def test_greedy_proposals_leave_their_one_hots_unbuilt(tiny_target):
    drafter = create_drafter("ngram", tiny_target.config)
    pool = tiny_target.model.new_pool(4, 8)
    pool.add_sequence(0)
    pool.extend([0], 6)
    batch = DraftBatch([0], torch.tensor([3]), [[1, 2, 3, 1, 2, 3]], pool,
                       SamplingBatch.from_params([SamplingParams()]), [torch.Generator()])
    proposal = drafter.propose(batch, K)
    assert proposal.draft_probs is None
    V = tiny_target.config.vocab_size
    assert torch.equal(proposal.probs(V), one_hot_probs(proposal.draft_tokens, V))
    given = Proposal(proposal.draft_tokens, torch.full((1, K, V), 1.0 / V))
    assert given.probs(V) is given.draft_probs
