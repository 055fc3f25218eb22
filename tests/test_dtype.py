"""`--dtype`: what auto picks on which hardware, and that a target loaded in a dtype runs wholly in it
(weights, KV pool, drafters). Greedy losslessness per dtype: tests/test_generate.py."""

from __future__ import annotations

import pytest
import torch

from hspec.machine import cpu_flags
from hspec.models.dtype import (
    DTYPE_CHOICES,
    cpu_has_native_bf16,
    drafter_int8,
    dtype_name,
    quantized_weights,
    resolve_dtype,
    slow_dtype_note,
)

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}


def test_auto_is_bf16_only_where_the_cpu_computes_it_natively():
    assert resolve_dtype("auto", "cpu", flags=AVX2_ONLY) == torch.float32
    assert resolve_dtype("auto", "cpu", flags=SAPPHIRE_RAPIDS) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", flags=AVX2_ONLY | {"avx512_bf16"}) == torch.bfloat16  # Zen 4
    assert resolve_dtype("auto", "cpu", flags=frozenset()) == torch.float32  # flags unknown: the safe choice
    assert resolve_dtype("auto", "cuda", flags=AVX2_ONLY) == torch.bfloat16


def test_named_dtypes_and_errors():
    assert resolve_dtype("float32") == resolve_dtype("fp32") == torch.float32
    assert resolve_dtype("bfloat16", flags=AVX2_ONLY) == torch.bfloat16  # asked for: honoured, even if slower
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert set(DTYPE_CHOICES) == {"auto", "fastest", "float32", "bfloat16", "int8", "int4", "w4a8"}
    for quantized in ("int8", "int4", "w4a8"):  # bf16 between the products
        assert resolve_dtype(quantized) == torch.bfloat16 and quantized_weights(quantized)
    assert not quantized_weights("bfloat16") and not quantized_weights(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'int2'.*auto, fastest, float32, bfloat16, int8, int4"):
        resolve_dtype("int2")
    with pytest.raises(ValueError, match="int64"):
        resolve_dtype(torch.int64)


def test_asking_for_bf16_where_it_is_emulated_says_so_and_names_the_faster_choice():
    note = slow_dtype_note("bfloat16", "cpu", flags=AVX2_ONLY)
    assert note is not None and "--dtype bfloat16" in note and "float32, which --dtype auto picks" in note
    assert slow_dtype_note(torch.bfloat16, "cpu", flags=AVX2_ONLY) == note
    assert slow_dtype_note("bfloat16", "cpu", flags=SAPPHIRE_RAPIDS) is None
    assert slow_dtype_note("bfloat16", "cuda", flags=AVX2_ONLY) is None
    for fine in ("auto", "float32", "int8", "int4", torch.float32):
        assert slow_dtype_note(fine, "cpu", flags=AVX2_ONLY) is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    cpu = "flags\t\t: fpu avx2 avx512_bf16\n"
    info.write_text(f"processor\t: 0\n{cpu}\nprocessor\t: 1\n{cpu}")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"} and cpu_has_native_bf16(cpu_flags(info))
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_a_bf16_target_runs_in_bf16_with_its_kv_multiplied_in_float32_on_the_cpu(tiny_dirs):
    from conftest import load_tiny
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    target = load_tiny(tiny_dirs["qwen2"], dtype=torch.bfloat16)
    assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}
    assert target.model.layers[0].self_attn.qkv.qkv_weight.dtype == torch.bfloat16
    drafter = build_drafter("hspec", target, random_weights=True, precision="floating")
    assert {p.dtype for p in drafter.parameters() if p.is_floating_point()} == {torch.bfloat16}
    decoder = SpeculativeDecoder(target.model, drafter, 3, eos_token_ids=())
    pool = decoder.new_pool([[1, 2, 3]], 8)
    # bf16 K/V values: a bf16 pool where hspec's kernel widens them, else float32 for torch's fp32 GEMMs
    assert pool.k.dtype == target.model.kv_dtype in (torch.bfloat16, torch.float32)
    assert pool.product_dtype == torch.float32
    out = decoder.generate([[1, 2, 3, 4]], SamplingParams(), 8, pool=pool)
    assert len(out.sequences[0].token_ids) == 8
    plain = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, eos_token_ids=())
    sampled = plain.generate([[1, 2, 3, 4]], SamplingParams(temperature=1.0), 8)  # probabilities are fp32
    assert all(0 <= t < target.config.vocab_size for t in sampled.sequences[0].token_ids)


def test_load_target_takes_a_dtype_name(tiny_dirs):
    """The commands pass `--dtype` names straight to load_target (auto resolved for this machine)."""
    from functools import partial

    from hspec.models.loading import load_target

    load = partial(load_target, str(tiny_dirs["llama"]), tokenizer=lambda directory, config: None)  # no HF files
    assert load(dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16
    assert load(dtype="auto").model.embed_tokens.weight.dtype == resolve_dtype("auto")
    with pytest.raises(ValueError, match="float16x"):
        load(dtype="float16x")


def test_drafter_precision_auto_is_int8_under_a_bf16_int8_or_int4_target_on_a_cpu_only():
    assert drafter_int8("auto", "bfloat16") and drafter_int8("auto", "int8") and drafter_int8("auto", "int4")
    assert not drafter_int8("auto", "float32")  # the exact reference stays floating
    assert not drafter_int8("auto", "bfloat16", "cuda")
    assert drafter_int8("int8", "float32") and not drafter_int8("floating", "int8")
    with pytest.raises(ValueError, match=r"'int4'.*auto, floating, int8"):
        drafter_int8("int4", "bfloat16")


@pytest.mark.parametrize("precision,linear_dtype", [("auto", torch.int8), ("floating", torch.bfloat16)])
def test_a_drafter_under_a_bf16_target_stores_its_linears_as_asked_and_stays_lossless(tiny_dirs, precision,
                                                                                         linear_dtype):
    from conftest import load_tiny
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    target = load_tiny(tiny_dirs["llama"], dtype=torch.bfloat16)
    torch.manual_seed(0)
    drafter = build_drafter("hspec", target, random_weights=True, precision=precision)
    assert drafter.layers[0].mlp.down_proj.weight.dtype == linear_dtype
    plain = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, eos_token_ids=())
    spec = SpeculativeDecoder(target.model, drafter, 3, eos_token_ids=())
    prompt = [[1, 5, 9, 14, 5, 9, 3, 7]]
    assert spec.generate(prompt, SamplingParams(), 24).sequences[0].token_ids == \
        plain.generate(prompt, SamplingParams(), 24).sequences[0].token_ids


def test_fastest_is_w4a8_where_the_kernels_run():
    """`--dtype fastest` (the demo's default) loads w4a8 where hspec's CPU kernels run, else what auto picks."""
    from hspec.models.loading import fastest_dtype
    from hspec.models.native import load_kernels

    assert fastest_dtype("cpu") == ("w4a8" if load_kernels() else "auto")
    assert fastest_dtype("meta") == "auto"  # not a CPU
