"""`--compile-drafter`: a drafter's block forward and greedy loop through torch.compile, lossless, eager fallback."""

from __future__ import annotations

import pytest
import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import compile as compile_module
from hspec.drafters import create_drafter
from hspec.drafters.compile import CompiledForward, compile_drafter
from hspec.models.loading import load_target
from hspec.runtime import build_drafter
from hspec.sampling import SamplingParams

PROMPT = [1, 5, 9, 14, 5, 9, 3, 7]


def _failing_compile(fn, **_):
    def compiled(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler")
    return compiled


def _greedy(target, drafter, K=3, tokens=20):
    return SpeculativeDecoder(target.model, drafter, K, eos_token_ids=()).generate(
        [PROMPT], SamplingParams(), tokens).sequences[0].token_ids


def test_a_failing_compile_warns_once_and_the_drafter_stays_eager(tiny_target, monkeypatch):
    monkeypatch.setattr(compile_module.torch, "compile", _failing_compile)
    drafter = build_drafter("hspec", tiny_target, random_weights=True, compiled=True)
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
