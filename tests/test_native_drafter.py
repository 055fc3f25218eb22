"""H-Spec's native greedy proposal (drafters/hspec/native.py, native_propose.cpp) against the Python path.

The native call computes the Python path's math in its order (its Mamba-2 mixer in one loop, whose exp and
SiLU may round otherwise in the last bit; its attention through hspec's kernel, which the Python path runs too
where `BlockAttention.kernel` is set), so on tiny random-weight targets its block logits are that Python path's
to rounding and its drafts equal them, in float32, bfloat16 (floating and int8 drafter weights) and under a
w4a8 target (w8a8 drafter weights); they are the plain Python path's (torch's products in the attention) to its
dtype's rounding, the drafts equal but at near-ties; the native call reads the pool's K/V in place; greedy
speculative output with it equals plain decoding; and
with it turned off (HSPEC_NATIVE_DRAFTER=0, or `native=False`) the Python path runs. A drafter whose layers
the native call would run in another order gives logits far outside that tolerance (the comparison would
catch it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import load_tiny
from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.block_attention import BlockAttention
from hspec.drafters.common import CONTEXT_MULTIPLE, BlockContext, NativeDrafts, build_block
from hspec.drafters.hspec.native import NativePropose, build_native_propose
from hspec.models.formats.w4a8 import W4A8_TILE_BYTES
from hspec.models.layers import Linear
from hspec.runtime import NATIVE_DRAFTER_ENV, for_inference, prepare_for_inference
from hspec.sampling import SamplingBatch, SamplingParams

K = 7
# (target dtype, drafter precision): floating float32 and bf16 drafters, int8 rows under bf16 (hspec's int8 or
# w8a8 kernel, by CPU), w8a8 rows under a w4a8 target, and w4a8 tiles under it (`--drafter-precision w4a8`).
SETTINGS = [("float32", "floating"), ("bfloat16", "floating"), ("bfloat16", "int8"), ("w4a8", "auto"),
            ("w4a8", "w4a8")]
PROMPTS = ["the native drafter", "proposes in one call", "x", "a longer prompt with more words in it than most"]


@pytest.fixture(scope="module")
def targets(tiny_dirs, native_propose_extension):
    return {}  # loaded on first use, per dtype (w4a8 skips where hspec's kernels do not run)


def _target(targets, tiny_dirs, dtype):
    if dtype not in targets:
        targets[dtype] = load_tiny(tiny_dirs["llama"], dtype=dtype)
    return targets[dtype]


def _drafter(target, precision, native=True, kind="hspec"):
    """A random-weight drafter of `kind` for `target` whose Markov head (if any) corrects (W2 starts at zero),
    prepared for inference as `hspec generate` prepares one, with the native proposal where `native`."""
    torch.manual_seed(0)
    drafter = create_drafter(kind, target.config, target_model=target.model)
    if drafter.markov is not None:
        with torch.no_grad():
            drafter.markov.W2.normal_(std=0.5)
    drafter = prepare_for_inference(drafter, target.model.dtype_name, "cpu", precision=precision, native=native)
    assert (drafter.native_greedy is not None) == native
    return drafter


def _contexts(target, drafter, lengths, seed=1):
    """For each prompt length: a pool holding one prefilled sequence of random tokens, and the greedy DraftBatch
    and BlockContext of its next proposal: the Python path's, and the native call's (the pool's K/V as stored,
    where it reads them so, as `propose` makes it)."""
    g = torch.Generator().manual_seed(seed)
    for n in lengths:
        pool = target.model.new_pool(2 * (n // 8 + 2), 8, drafter.num_drafter_layers)  # DFlash: its own K/V
        pool.add_sequence(0)
        ids = torch.randint(3, target.config.vocab_size, (1, n), generator=g)
        with torch.no_grad():
            out = target.model.prefill(ids, pool, [0], hidden_layers=drafter.target_layers)
        drafter.commit(pool, [0], out.hidden, torch.tensor([n]))
        anchor = ids[:, -1]
        batch = DraftBatch([0], anchor, [ids[0].tolist()], pool, SamplingBatch.from_params([SamplingParams()]),
                           [torch.Generator()])
        block, positions = build_block(anchor, torch.tensor([n]), K, drafter.config.mask_token_id)
        kv, mask = drafter.context_kv_from_pool(pool, [0], [n], CONTEXT_MULTIPLE)
        stored = drafter.native_greedy is not None and drafter.native_greedy.reads_stored_kv
        yield (batch, BlockContext(block, positions, drafter.last_hidden_of([0]), kv, mask),
               drafter.block_context(batch, K, as_stored=stored))
        drafter.release(0)


def _kernel_attention(drafter, on: bool) -> None:
    """The drafter's attention modules attend through hspec's kernel (`BlockAttention.kernel`) where `on`."""
    for module in drafter.modules():
        if isinstance(module, BlockAttention):
            module.kernel = on


# The native call's attention is hspec's kernel (where it runs here, `reads_stored_kv`), which sums in the
# target's attention's order, not torch's products': its reference to the last bits is the Python path run with
# that kernel (`BlockAttention.kernel`). The plain Python path differs by its products' rounding: in bf16 each
# score comes out of a bf16 product rounded to bf16 (~0.4% of it), which moves a tiny random drafter's logits
# by up to ~0.2 (at magnitudes ~4) after its layers; float32 rounds ~1e-7 of it.
PLAIN_PATH_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 0.3}


def _assert_near_the_plain_python_path(drafter, ctx, anchor, local, logits) -> int:
    """The native call's logits against the plain Python path's within its rounding (`PLAIN_PATH_TOLERANCE`),
    and its drafts slot by slot up to the first whose top-2 margin in the Python path is within twice the
    slot's largest logit difference between the two (a near-tie that rounding may flip, where either draft is
    right; each later slot is conditioned on it through the Markov head). Returns how many slots were compared."""
    expected = drafter.block_logits(ctx)  # (1, K, Vp)
    tolerance = PLAIN_PATH_TOLERANCE[expected.dtype]
    torch.testing.assert_close(logits.float(), expected.float(), rtol=tolerance, atol=tolerance)
    expected_local, _ = drafter.draft_greedy(ctx, anchor)
    prev = anchor
    for k in range(expected.shape[1]):
        python = drafter.slot_logits(expected[:, k], prev).float()  # (1, Vp)
        difference = (drafter.slot_logits(logits[:, k], prev).float() - python).abs().max()
        top = python.topk(2).values[0]  # (2,)
        if top[0] - top[1] <= 2 * difference:
            return k
        assert local[0, k] == expected_local[0, k], f"slot {k}, margin {top[0] - top[1]:.3f}"
        prev = drafter.head.to_target_ids(expected_local[:, k])
    return expected.shape[1]


@pytest.mark.parametrize("dtype,precision", SETTINGS)
def test_native_drafts_equal_the_python_path(targets, tiny_dirs, dtype, precision):
    target = _target(targets, tiny_dirs, dtype)
    drafter = _drafter(target, precision)
    native = drafter.native_greedy
    drafts, compared = [], 0
    with torch.inference_mode():
        for batch, ctx, native_ctx in _contexts(target, drafter, (1, 5, 17, 40, 100)):
            anchor = batch.anchor_tokens
            local, confidence, logits = native.forward(native_ctx, anchor)
            compared += _assert_near_the_plain_python_path(drafter, ctx, anchor, local, logits)
            _kernel_attention(drafter, native.reads_stored_kv)  # the Python path with the native call's attention
            expected_logits = drafter.block_logits(ctx)
            torch.testing.assert_close(logits.float(), expected_logits.float(), rtol=1e-2, atol=1e-2)
            expected_local, expected_confidence = drafter.draft_greedy(ctx, anchor)
            assert torch.equal(local, expected_local)
            torch.testing.assert_close(confidence, expected_confidence)
            # propose takes the native path and returns what the Python path returns
            assert native.covers(native_ctx) and native.covers_batch(batch, K)
            proposal = drafter.propose(batch, K)
            drafter.native_greedy = None
            python = drafter.propose(batch, K)
            drafter.native_greedy = native
            _kernel_attention(drafter, False)
            assert torch.equal(proposal.draft_tokens, python.draft_tokens)
            assert proposal.draft_probs is None and python.draft_probs is None  # greedy: one-hot, not built
            drafts.append(local)
    assert len({tuple(d[0].tolist()) for d in drafts}) > 1, "every context drafted the same block"
    assert compared >= K, f"only {compared} slots were far enough from a tie to compare with the plain Python path"


def test_the_breakdown_times_each_section_of_a_proposal(targets, tiny_dirs):
    """A timed proposal (hspec bench draft --breakdown), from a `BlockContext` or from the pool in place, returns
    every section native_propose.cpp times, each once, with a positive wall time wherever the drafter runs that
    section, and the whole call's time, which holds them all."""
    target = _target(targets, tiny_dirs, "bfloat16")
    drafter = _drafter(target, "int8")
    native = drafter.native_greedy
    timings = []
    with torch.inference_mode():
        for batch, _, native_ctx in _contexts(target, drafter, (17,)):
            timings.append(native.propose(native_ctx, batch.anchor_tokens, timed=True).timings)
            assert native.propose(native_ctx, batch.anchor_tokens).timings.numel() == 0
            if native.reads_in_place:
                timings.append(drafter.native_drafts(native, batch, K, timed=True).timings)
    for timing in timings:
        sections, (call_cpu, call_wall) = native.section_times(timing)
        assert list(sections) == native.extension.section_names() and len(sections) == 19
        assert all(cpu >= 0.0 and wall >= 0.0 for cpu, wall in sections.values())
        ran = ("embed", "injection", "norms", "mamba.in_proj", "mamba.conv_silu", "mamba.scan_gate_norm",
               "attention.qkv_proj", "attention.attend", "mlp.gate_up", "mlp.down", "head",
               "markov.w2_product", "markov.argmax_softmax")
        assert all(sections[name][1] > 0.0 for name in ran), {name: sections[name] for name in ran}
        assert call_wall >= sum(wall for _, wall in sections.values()) > 0.0


def test_a_w4a8_drafter_multiplies_w4a8_tiles(targets, tiny_dirs):
    """`--drafter-precision w4a8` stores the layers' linears, the head's rows and the Markov head's W2 as the
    w4a8 kernel's tiles wherever it takes the shape, which the native call then multiplies."""
    target = _target(targets, tiny_dirs, "w4a8")
    drafter = _drafter(target, "w4a8")
    tiles = [m.weight_packed for m in drafter.modules() if isinstance(m, Linear) and m.weight_packed is not None]
    assert tiles and any(p.dtype == torch.uint8 and p.shape[-1] == W4A8_TILE_BYTES for p in tiles)
    _, _, head_tiles = drafter.head.inference_weights(torch.bfloat16)
    _, _, w2_tiles = drafter.markov.int8_weights(torch.bfloat16)
    for packed in (head_tiles, w2_tiles):
        assert packed is not None and packed.dtype == torch.uint8 and packed.shape[-1] == W4A8_TILE_BYTES


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "int8"), ("w4a8", "auto"), ("w4a8", "w4a8")])
def test_kept_markov_corrections_give_the_computed_ones_bits(targets, tiny_dirs, dtype, precision):
    """A proposer that keeps the Markov head's corrections by previous token (`Corrections`, its int8 or w4a8
    W2) drafts what one that multiplies W2 at every slot drafts, bit for bit, on first sight of a token and
    on the second pass over the same contexts, where every correction is a kept one."""
    target = _target(targets, tiny_dirs, dtype)
    drafter = _drafter(target, precision)
    keeping = drafter.native_greedy
    assert keeping.keep_corrections and keeping.markov == 2  # the int8 (or w4a8) W2 copy the cache is for
    computing = copy.copy(keeping)  # the same weights (a oneDNN-packed copy does not deep-copy)
    computing.keep_corrections = False
    computing.proposer = computing._bind()
    with torch.inference_mode():
        contexts = [(batch.anchor_tokens, native_ctx) for batch, _, native_ctx in
                    _contexts(target, drafter, (1, 5, 17, 40))]
        outputs = [[], []]
        for _ in range(2):
            for anchor, native_ctx in contexts:
                for side, native in zip(outputs, (keeping, computing)):
                    out = native.propose(native_ctx, anchor)
                    side.append((out.drafts, out.local, out.confidence, out.logits))
    for kept, computed in zip(*outputs):
        for a, b in zip(kept, computed):
            assert torch.equal(a, b)
    assert len({tuple(out[0][0].tolist()) for out in outputs[0]}) > 1, "every context drafted the same block"


# H-Spec's ablations (paper §4.3, B.4) are the same class with other modules: no S_init, no Markov head, only
# Mamba-2 or only attention layers. hspec-lasttoken-only's attention sees the block alone, which the native call
# does not take (`NativePropose.unfit_reason`).
ABLATIONS = ("hspec-kvreuse-only", "hspec-nomarkov", "mamba-only", "attention-only")


def _assert_native_equals_python(target, drafter) -> None:
    """The native call's block logits, greedy drafts and confidences against the Python path's, at two contexts."""
    with torch.inference_mode():
        for batch, ctx, native_ctx in _contexts(target, drafter, (9, 33)):
            local, confidence, logits = drafter.native_greedy.forward(native_ctx, batch.anchor_tokens)
            _assert_near_the_plain_python_path(drafter, ctx, batch.anchor_tokens, local, logits)
            _kernel_attention(drafter, drafter.native_greedy.reads_stored_kv)
            torch.testing.assert_close(logits.float(), drafter.block_logits(ctx).float(), rtol=1e-2, atol=1e-2)
            expected_local, expected_confidence = drafter.draft_greedy(ctx, batch.anchor_tokens)
            _kernel_attention(drafter, False)
            assert torch.equal(local, expected_local)
            torch.testing.assert_close(confidence, expected_confidence)


@pytest.mark.parametrize("kind", ABLATIONS)
def test_native_drafts_of_the_ablations_equal_the_python_path(targets, tiny_dirs, kind):
    target = _target(targets, tiny_dirs, "bfloat16")
    drafter = _drafter(target, "auto", kind=kind)
    _assert_native_equals_python(target, drafter)


# The DFlash family runs through the same native call: attention over its context (DFlash and DSpark: their
# own K/V in the pool; DFlash-KVReuse: the target's) attending to the whole block, no Mamba-2, DSpark with the
# Markov head.
DFLASH_FAMILY = ("dflash", "dspark", "dflash-kvreuse")


@pytest.mark.parametrize("kind", DFLASH_FAMILY)
@pytest.mark.parametrize("dtype,precision", [("bfloat16", "int8"), ("w4a8", "auto")])
def test_native_drafts_of_the_dflash_family_equal_the_python_path(targets, tiny_dirs, kind, dtype, precision):
    target = _target(targets, tiny_dirs, dtype)
    drafter = _drafter(target, precision, kind=kind)
    assert not drafter.native_greedy.causal
    _assert_native_equals_python(target, drafter)


@pytest.mark.parametrize("kind", ("dflash2", "dfly", "specblock"))
def test_kinds_with_their_own_proposal_on_dflash_layers_propose_in_python(targets, tiny_dirs, kind):
    """Kinds built on DFlash's backbone that override what the native call computes keep their own proposal."""
    target = _target(targets, tiny_dirs, "bfloat16")
    drafter = create_drafter(kind, target.config, target_model=target.model)
    assert "overrides" in NativePropose.unfit_reason(drafter)
    assert prepare_for_inference(drafter, "bfloat16", "cpu").native_greedy is None


def test_a_drafter_whose_attention_sees_the_block_alone_proposes_in_python(targets, tiny_dirs):
    target = _target(targets, tiny_dirs, "bfloat16")
    drafter = create_drafter("hspec-lasttoken-only", target.config, target_model=target.model)
    assert "attend_target" in NativePropose.unfit_reason(drafter)
    assert prepare_for_inference(drafter, target.model.dtype_name, "cpu", native=True).native_greedy is None


def test_a_wrong_layer_order_gives_other_logits(targets, tiny_dirs):
    """The equality above would catch a native call that ran the layers in another order: binding it to the
    drafter with its first two (full) layers swapped gives logits that differ from the drafter's."""
    target = _target(targets, tiny_dirs, "float32")
    drafter = _drafter(target, "floating")
    swapped = copy.deepcopy(drafter)
    swapped.layers = nn.ModuleList([swapped.layers[1], swapped.layers[0], *swapped.layers[2:]])
    wrong = NativePropose(drafter.native_greedy.extension, swapped)
    with torch.inference_mode():
        for batch, ctx, native_ctx in _contexts(target, drafter, (20,)):
            _, _, logits = wrong.forward(native_ctx, batch.anchor_tokens)
            assert (logits - drafter.block_logits(ctx)).abs().max() > 1e-2


def _decoder(target, drafter, K):
    return SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids, target.tokenizer.decode)


class _Counting:
    """A native proposal that counts the proposals it made (from the pool in place, `in_place`, or from a
    `BlockContext`) and keeps the last context it was given (the pool, for one made in place)."""

    def __init__(self, native: NativePropose) -> None:
        self.native, self.calls, self.in_place = native, 0, 0
        self.reads_stored_kv, self.reads_in_place = native.reads_stored_kv, native.reads_in_place
        self.last: BlockContext | PagedKVPool | None = None

    def covers(self, ctx: BlockContext) -> bool:
        return self.native.covers(ctx)

    def covers_batch(self, batch: DraftBatch, K: int) -> bool:
        return self.native.covers_batch(batch, K)

    def __call__(self, ctx: BlockContext, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.propose(ctx, anchor_tokens)
        return out.local, out.confidence

    def propose(self, ctx: BlockContext, anchor_tokens: torch.Tensor, timed: bool = False) -> NativeDrafts:
        self.calls += 1
        self.last = ctx
        return self.native.propose(ctx, anchor_tokens, timed)

    def propose_in_pool(self, anchor_tokens, K, last_hidden, pool, seq_id, layers, window, timed=False):
        out = self.native.propose_in_pool(anchor_tokens, K, last_hidden, pool, seq_id, layers, window, timed)
        if out is not None:
            self.calls += 1
            self.in_place += 1
            self.last = pool
        return out


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "auto"), ("w4a8", "auto"), ("w4a8", "w4a8")])
def test_greedy_output_with_the_native_drafter_equals_plain(targets, tiny_dirs, dtype, precision):
    target = _target(targets, tiny_dirs, dtype)
    drafter = _drafter(target, precision)
    counting = drafter.native_greedy = _Counting(drafter.native_greedy)
    plain = _decoder(target, create_drafter("none", target.config), 1)
    for prompt in PROMPTS:  # one sequence at a time: what the native call covers
        ids = [target.tokenizer.encode_prompt(prompt)]
        expected = plain.generate(ids, SamplingParams(), 40).sequences[0]
        got = _decoder(target, drafter, K).generate(ids, SamplingParams(), 40).sequences[0]
        assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
    assert counting.calls > 0, "no proposal went native"


@pytest.mark.parametrize("dtype,precision", [("float32", "floating"), ("w4a8", "auto")])
def test_the_native_proposal_reads_the_pool_in_place(targets, tiny_dirs, dtype, precision):
    """`propose` hands the native call the pool itself, whose K/V the call reads as views in their own dtype,
    not copies: a w4a8 target's bf16 pool, which torch's products take widened to float32 copies, reaches
    hspec's kernel as it is stored (the kernel widens each key and value as it loads it). Where the sequence's
    pages are not consecutive, the `BlockContext` it is handed instead holds the pool's K/V in their dtype."""
    target = _target(targets, tiny_dirs, dtype)
    drafter = _drafter(target, precision)
    if not drafter.native_greedy.reads_in_place:
        pytest.skip("hspec's CPU kernels do not run here: the native call multiplies as the Python path does")
    counting = drafter.native_greedy = _Counting(drafter.native_greedy)
    with torch.inference_mode():
        for batch, python_ctx, _ in _contexts(target, drafter, (40,)):
            drafter.propose(batch, K)
            widened = python_ctx.context_kv[0][0].dtype == torch.float32
            pool = batch.pool
            assert counting.calls == counting.in_place == 1 and counting.last is pool
            pool._page_tables[0].reverse()  # the same pages, no longer consecutive
            drafter.propose(batch, K)
    assert counting.calls == 2 and counting.in_place == 1
    if dtype == "w4a8":  # the case that copied: the Python path's context is float32
        assert pool.k.dtype == torch.bfloat16 and widened
    for k, v in counting.last.context_kv:
        for read, stored in ((k, pool.k), (v, pool.v)):
            assert read.dtype == stored.dtype


def test_batches_and_sampled_rows_keep_the_python_path(targets, tiny_dirs):
    target = _target(targets, tiny_dirs, "bfloat16")
    drafter = _drafter(target, "auto")
    counting = drafter.native_greedy = _Counting(drafter.native_greedy)
    ids = [target.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    plain = _decoder(target, create_drafter("none", target.config), 1).generate(ids, SamplingParams(), 24)
    got = _decoder(target, drafter, K).generate(ids, SamplingParams(), 24)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in plain.sequences]
    _decoder(target, drafter, K).generate(ids[:1], SamplingParams(temperature=1.0), 8)
    assert counting.calls == 0


def test_turned_off_the_python_path_runs(targets, tiny_dirs, monkeypatch):
    """HSPEC_NATIVE_DRAFTER=0 when the drafter is prepared, or native=False, keeps every proposal in Python."""
    target = _target(targets, tiny_dirs, "bfloat16")
    monkeypatch.setenv(NATIVE_DRAFTER_ENV, "0")
    fresh = create_drafter("hspec", target.config, target_model=target.model)
    assert for_inference(fresh, target).native_greedy is None
    monkeypatch.delenv(NATIVE_DRAFTER_ENV)
    assert for_inference(create_drafter("hspec", target.config, target_model=target.model), target).native_greedy
    off = _drafter(target, "auto", native=False)
    plain = _decoder(target, create_drafter("none", target.config), 1)
    ids = [target.tokenizer.encode_prompt(PROMPTS[0])]
    expected = plain.generate(ids, SamplingParams(), 32).sequences[0].token_ids
    assert _decoder(target, off, K).generate(ids, SamplingParams(), 32).sequences[0].token_ids == expected


def test_unfit_drafters_are_named(targets, tiny_dirs):
    target = _target(targets, tiny_dirs, "float32")
    drafter = create_drafter("hspec", target.config, target_model=target.model)
    assert NativePropose.unfit_reason(drafter) is None
    from hspec.models.weight_layout import fuse_projections

    drafter.requires_grad_(False)
    fuse_projections(drafter)
    assert "unfused" in NativePropose.unfit_reason(drafter)
    with pytest.raises(ValueError, match="does not take"):
        NativePropose(build_native_propose(), drafter)
