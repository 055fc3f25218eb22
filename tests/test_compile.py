"""`--compile-drafter`: a drafter's block forward and greedy loop through torch.compile, lossless, eager fallback."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import ahead_of_time, create_drafter
from hspec.drafters import compile as compile_module
from hspec.drafters.ahead_of_time import AheadOfTimeForward
from hspec.drafters.base import DraftBatch
from hspec.drafters.common import BlockContext
from hspec.drafters.compile import CompiledForward, compile_drafter
from hspec.models.loading import load_target
from hspec.runtime import build_drafter
from hspec.sampling import SamplingBatch, SamplingParams

PROMPT = [1, 5, 9, 14, 5, 9, 3, 7]


@pytest.fixture(autouse=True)
def _without_the_native_proposal(monkeypatch):
    """These tests exercise the compiled forwards, which H-Spec's native proposal (drafters/hspec/native.py)
    would bypass for a greedy sequence: drafters here are prepared without it."""
    monkeypatch.setenv("HSPEC_NATIVE_DRAFTER", "0")


def _failing_compile(fn, **_):
    def compiled(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler")
    return compiled


def _greedy(target, drafter, K=3, tokens=20):
    return SpeculativeDecoder(target.model, drafter, K, eos_token_ids=()).generate(
        [PROMPT], SamplingParams(), tokens).sequences[0].token_ids


def test_a_failing_compile_warns_once_and_the_drafter_stays_eager(tiny_target, monkeypatch):
    monkeypatch.setattr(compile_module.torch, "compile", _failing_compile)
    drafter = build_drafter("hspec", tiny_target, random_weights=True)
    compile_drafter(drafter, ahead_of_time=False)  # torch.compile's path only
    block, greedy = drafter.block_logits, drafter.draft_greedy
    assert all(isinstance(w, CompiledForward) and w.is_compiled for w in (block, greedy))
    plain = _greedy(tiny_target, create_drafter("none", tiny_target.config), K=1)
    with pytest.warns(RuntimeWarning) as warned:  # greedy rows run draft_greedy only
        assert _greedy(tiny_target, drafter) == plain
    assert [str(w.message) for w in warned] == [
        "torch.compile failed for drafter 'hspec' (draft_greedy), which stays eager: RuntimeError: inductor: no C++ "
        "compiler"]  # once, not once per step
    assert not greedy.is_compiled and block.is_compiled  # later greedy calls go straight to the eager method
    decoder = SpeculativeDecoder(tiny_target.model, drafter, 3, eos_token_ids=())
    with pytest.warns(RuntimeWarning, match=r"\(block_logits\)"):  # sampled rows run the block forward
        decoder.generate([PROMPT], SamplingParams(temperature=1.0), 12)
    assert not block.is_compiled


def test_an_error_of_the_forward_itself_still_raises(tiny_target, monkeypatch):
    monkeypatch.setattr(compile_module.torch, "compile", _failing_compile)
    drafter = build_drafter("hspec", tiny_target, random_weights=True)
    compile_drafter(drafter)
    with pytest.raises(AttributeError):
        drafter.block_logits(None)  # the eager forward's own error, not a compile warning
    with pytest.raises(AttributeError):
        drafter.draft_greedy(None, None)


def test_compiled_reaches_the_trained_kind_behind_wrappers_and_skips_model_free_kinds(tiny_target, monkeypatch):
    monkeypatch.setattr(compile_module.torch, "compile", lambda fn, **_: fn)
    behind = build_drafter("hspec+ngram:0.4", tiny_target, random_weights=True, compiled=True)
    assert isinstance(behind.model.model.block_logits, CompiledForward)
    assert isinstance(behind.model.model.draft_greedy, CompiledForward)
    assert not isinstance(build_drafter("hspec", tiny_target, random_weights=True).block_logits,
                          CompiledForward)
    assert build_drafter("ngram", tiny_target, compiled=True).kind == "ngram"
    drafter = build_drafter("hspec", tiny_target, random_weights=True)
    assert compile_drafter(drafter) == compile_drafter(drafter)  # compiled once


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_a_compiled_drafter_keeps_greedy_output_equal_to_plain(tiny_target, kind):
    """A real inductor compile (minutes on 2 cores without inductor's cache): drafts may round
    differently from the eager drafter's, the output must equal plain decoding's."""
    torch.manual_seed(0)
    drafter = build_drafter(kind, tiny_target, random_weights=True, compiled=True)
    plain = _greedy(tiny_target, create_drafter("none", tiny_target.config), K=1, tokens=32)
    assert _greedy(tiny_target, drafter, tokens=32) == plain
    prompts = [PROMPT, PROMPT[:5]]  # two sequences: torch.compile's greedy path, not the ahead-of-time one
    none = SpeculativeDecoder(tiny_target.model, create_drafter("none", tiny_target.config), 1, eos_token_ids=())
    decoder = SpeculativeDecoder(tiny_target.model, drafter, 3, eos_token_ids=())
    plain = [s.token_ids for s in none.generate(prompts, SamplingParams(), 24).sequences]
    assert [s.token_ids for s in decoder.generate(prompts, SamplingParams(), 24).sequences] == plain
    assert drafter.block_logits.is_compiled and drafter.draft_greedy.is_compiled


@pytest.mark.slow
def test_a_compiled_drafter_compiles_once_whatever_the_context_length():
    """SmolLM2 in int4 with its shipped H-Spec drafter: a first decode whose proposals read 64 keys (the
    head dim) from a pool of 64 slots, then contexts of every length to 170 must reuse the first compile.
    Dynamo's duck shapes had tied those 64 keys to the head dim, and a read spanning the pool to K's
    stride, and recompiled (~40 s) in the middle of an evaluated decode."""
    target = load_target("smollm2", dtype="int4")
    drafter = build_drafter("hspec", target, compiled=True)
    decoder = SpeculativeDecoder(target.model, drafter, 3, eos_token_ids=())
    with torch.inference_mode():
        decoder.generate([target.tokenizer.encode_prompt("Hi")], SamplingParams(), 16)
        prompt = target.tokenizer.encode_prompt("Write a long essay about the history of the bicycle.")
        with torch._dynamo.config.patch(error_on_recompile=True):
            decoder.generate([prompt], SamplingParams(), 120)
    assert drafter.draft_greedy.is_compiled


@pytest.mark.slow
def test_a_compiled_int8_drafter_multiplies_in_hspecs_kernel(tiny_dirs):
    """Under a bf16 target on a CPU the drafter's linears and head are int8 (`prepare_for_inference`); the
    compiled forward must call hspec's int8 kernel, or its w8a8 one where the CPU has AVX512-VNNI
    (`runtime.int8_kernel`; torch.compile knows their output shapes), rather than torch's
    `_weight_int8pack_mm`, which takes 2-50x as long on an AVX2-only CPU; the output stays plain's."""
    from torch.profiler import ProfilerActivity, profile

    from conftest import load_tiny
    from hspec.models.native import integer_capability, kernels_loaded

    target = load_tiny(tiny_dirs["llama"], dtype="bfloat16")
    if not kernels_loaded():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(0)
    drafter = build_drafter("hspec", target, random_weights=True, compiled=True)
    plain = _greedy(target, create_drafter("none", target.config), K=1, tokens=24)
    _greedy(target, drafter, tokens=8)  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as run:
        assert _greedy(target, drafter, tokens=24) == plain
    called = {event.key for event in run.key_averages()}
    assert drafter.block_logits.is_compiled
    kernel = "hspec::w8a8_linear" if integer_capability() == "avx512_vnni" else "hspec::int8_linear"
    assert kernel in called and "aten::_weight_int8pack_mm" not in called


# ---- the ahead-of-time greedy proposal (drafters/ahead_of_time.py) ------------------------------------


def _refuse_compile(*_, **__):
    raise RuntimeError("no C++ compiler")


def test_a_failing_ahead_of_time_compile_warns_once_and_torch_compile_takes_over(tiny_target, monkeypatch, tmp_path):
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(compile_module.torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(ahead_of_time.torch._inductor, "aoti_compile_and_package", _refuse_compile)
    drafter = build_drafter("hspec", tiny_target, random_weights=True, compiled=True)
    assert drafter.draft_greedy.ahead_of_time is not None and drafter.block_logits.ahead_of_time is not None
    plain = _greedy(tiny_target, create_drafter("none", tiny_target.config), K=1)
    with pytest.warns(RuntimeWarning) as warned:
        assert _greedy(tiny_target, drafter) == plain
    assert [str(w.message) for w in warned] == [
        "the ahead-of-time compile failed for drafter 'hspec' (draft_greedy), which runs through torch.compile: "
        "RuntimeError: no C++ compiler"]  # once, not once per step
    assert drafter.draft_greedy.ahead_of_time is None and drafter.draft_greedy.is_compiled
    assert not list(tmp_path.rglob("*.pt2"))  # nothing half-written is left in the cache


def test_context_views_are_passed_in_the_layout_of_the_signature():
    """Windows of a pool of any capacity: K stored keys-innermost (as a row-invariant target's pool stores it)
    goes keys-innermost, (1, Hkv, D, W) with the window its first keys: the store itself where its rows fit in the
    storage (no copy), a contiguous copy where they would run past its end; V (rows of Hkv x D) goes contiguous.
    The compiled library does not read strides, so every input is contiguous."""
    hkv, d, keys = 2, 8, 40
    for capacity in (64, 96):
        store = torch.randn(2, hkv, d, capacity)  # two layers of K^T
        v = torch.randn(1, capacity, hkv, d)[:, 8:8 + keys]  # (1, S, Hkv, D)
        for layer, copied in ((0, False), (1, True)):  # the last layer's rows would run past the storage
            k = store[layer][None].permute(0, 3, 1, 2)[:, 8:8 + keys]  # (1, S, Hkv, D), keys stride 1
            ctx = BlockContext(torch.zeros(1, 3, dtype=torch.long), torch.arange(48, 51)[None],
                               torch.zeros(1, 2, 16), [(k, v)], torch.ones(1, keys, dtype=torch.bool))
            signature = AheadOfTimeForward.signature_of(ctx)
            assert signature.context == ((torch.float32, True), (torch.float32, False))
            inputs = AheadOfTimeForward._inputs(ctx, torch.zeros(1, dtype=torch.long), signature)
            assert all(t.is_contiguous() for t in inputs)
            passed = inputs[5]
            assert passed.shape == (1, hkv, d, keys if copied else capacity)
            assert (passed.data_ptr() == k.data_ptr()) is not copied
            assert torch.equal(passed[..., :keys].permute(0, 3, 1, 2), k) and torch.equal(inputs[6], v)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hspec", "dflash", "mamba-only"])
def test_an_ahead_of_time_drafter_keeps_greedy_output_and_loads_from_the_cache(tiny_target, kind, monkeypatch,
                                                                                tmp_path):
    """A real AOTInductor compile (~30 s on 2 cores): the output equals plain decoding's, the drafts are
    (nearly all) the eager drafter's, and a second drafter with the same weights loads the library from the
    cache instead of compiling; a drafter with other weights gets a library of its own."""
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    drafter = build_drafter(kind, tiny_target, random_weights=True, compiled=True)
    plain = _greedy(tiny_target, create_drafter("none", tiny_target.config), K=1, tokens=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        assert _greedy(tiny_target, drafter, tokens=32) == plain
    assert drafter.draft_greedy.ahead_of_time.runners and len(list(tmp_path.rglob("*.pt2"))) == 1
    twin = build_drafter(kind, tiny_target, random_weights=True, compiled=True)
    twin.load_state_dict(drafter.state_dict())
    monkeypatch.setattr(ahead_of_time.torch._inductor, "aoti_compile_and_package", _refuse_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _greedy(tiny_target, twin, tokens=32) == plain
    eager = build_drafter(kind, tiny_target, random_weights=True)
    eager.load_state_dict(drafter.state_dict())
    pool = tiny_target.model.new_pool(8, 16, drafter.num_drafter_layers)
    pool.add_sequence(0)
    pool.extend([0], len(PROMPT))
    pool.k.normal_()
    pool.v.normal_()
    hidden = torch.randn(1, len(PROMPT), len(drafter.target_layers), tiny_target.config.hidden_size)
    batch = DraftBatch([0], torch.tensor([PROMPT[-1]]), [PROMPT], pool,
                       SamplingBatch.from_params([SamplingParams()]), [torch.Generator().manual_seed(0)])
    with torch.inference_mode():
        for d in (drafter, eager):
            d.commit(pool, [0], hidden, torch.tensor([len(PROMPT)]))
        drafts = drafter.propose(batch, 3).draft_tokens
        assert int((drafts == eager.propose(batch, 3).draft_tokens).sum()) >= drafts.numel() - 1


@pytest.mark.slow
def test_a_sampled_row_runs_the_block_forward_ahead_of_time(tiny_target, monkeypatch, tmp_path):
    """`block_logits` of one sequence through its own library: the eager forward's logits up to rounding, and a
    sampled decode runs on it without falling back."""
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    drafter = build_drafter("hspec", tiny_target, random_weights=True, compiled=True)
    eager = build_drafter("hspec", tiny_target, random_weights=True)
    eager.load_state_dict(drafter.state_dict())
    pool = tiny_target.model.new_pool(8, 16, 0)
    pool.add_sequence(0)
    pool.extend([0], 40)
    pool.k.normal_()
    pool.v.normal_()
    context, mask = eager.context_kv_from_pool(pool, [0], [40], 32)
    ctx = BlockContext(torch.tensor([[5, 0, 0]]), torch.arange(40, 43)[None],
                       torch.randn(1, len(eager.target_layers), tiny_target.config.hidden_size), context, mask)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.testing.assert_close(drafter.block_logits(ctx), eager.block_logits(ctx), atol=1e-4, rtol=1e-4)
        assert drafter.block_logits.ahead_of_time.runners
        decoder = SpeculativeDecoder(tiny_target.model, drafter, 3, eos_token_ids=())
        out = decoder.generate([PROMPT], SamplingParams(temperature=1.0), 16).sequences[0]
    assert len(out.token_ids) == 16 and not drafter.draft_greedy.ahead_of_time.runners


def test_the_cache_keeps_the_most_recently_used_libraries_and_compiles_in_progress(tmp_path):
    for i in range(5):
        library = tmp_path / f"hspec-draft_greedy-K7-{i}.pt2"
        library.write_bytes(b"x")
        os.utime(library, (1000 + i, 1000 + i))
    partial = tmp_path / "partial-abc.pt2"  # a compile in progress: written to just now
    partial.write_bytes(b"x")
    deleted = ahead_of_time.prune_cache(tmp_path, keep=3)
    assert sorted(p.name for p in deleted) == ["hspec-draft_greedy-K7-0.pt2", "hspec-draft_greedy-K7-1.pt2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hspec-draft_greedy-K7-2.pt2", "hspec-draft_greedy-K7-3.pt2", "hspec-draft_greedy-K7-4.pt2", "partial-abc.pt2"]


def test_the_cache_deletes_the_partial_file_of_a_killed_compile(tmp_path):
    stopped = tmp_path / "partial-killed.pt2"
    stopped.write_bytes(b"x")
    os.utime(stopped, (1, 1))  # untouched for far longer than a compile takes
    running = tmp_path / "partial-running.pt2"
    running.write_bytes(b"x")
    assert ahead_of_time.prune_cache(tmp_path) == [stopped]
    assert [p.name for p in tmp_path.iterdir()] == ["partial-running.pt2"]
