"""Linear weights in the fast CPU layout (fp32 column-major, bf16 row-major): same values, ties kept, same outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hspec.models.weight_layout import store_linear_weights_in_fast_layout


def _is_column_major(weight: torch.Tensor) -> bool:
    """Consecutive output rows are adjacent in memory: the transpose of a contiguous (in, out) matrix, or
    a block of rows of one (a projection stacked by `fuse_projections`)."""
    return weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0] > 1


def test_values_kept_ties_kept_outputs_equal():
    torch.manual_seed(0)
    shared = nn.Linear(6, 10, bias=False)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), shared)
    twin = nn.Linear(6, 10, bias=False)
    twin.weight = shared.weight  # a tied weight, as an LM head tied to its embedding
    model.append(nn.Identity())
    model.twin = twin
    x = torch.randn(3, 4)
    before = model[:3](x)
    values = [p.detach().clone() for p in model.parameters()]
    store_linear_weights_in_fast_layout(model)
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))
    assert _is_column_major(model[0].weight) and _is_column_major(shared.weight)
    assert model.twin.weight is shared.weight
    assert torch.allclose(model[:3](x), before, atol=1e-6)
    store_linear_weights_in_fast_layout(model)  # idempotent
    assert _is_column_major(model[0].weight)


def test_reduced_precision_weights_stay_row_major():
    """bf16 GEMMs run faster on row-major weights on CPU (docs/fast-path.md), so only fp32 is re-stored."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).to(torch.bfloat16)
    model.append(nn.Linear(3, 5))  # fp32 beside them
    store_linear_weights_in_fast_layout(model)
    assert model[0].weight.is_contiguous() and model[1].weight.is_contiguous()
    assert _is_column_major(model[2].weight)


def test_embedding_tied_to_a_linear_keeps_sharing_it():
    embed = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    rows = embed(torch.tensor([1, 7])).detach().clone()
    store_linear_weights_in_fast_layout(model)
    assert model["embed"].weight is model["head"].weight and _is_column_major(model["head"].weight)
    assert torch.equal(model["embed"](torch.tensor([1, 7])), rows)


def test_tied_tiny_target_keeps_its_tie(tiny_dirs):
    from conftest import load_tiny

    tied = [name for name in tiny_dirs if load_tiny(tiny_dirs[name]).config.tie_word_embeddings]
    assert tied
    target = load_tiny(tiny_dirs[tied[0]])
    assert target.model.embed_tokens.weight is target.model.lm_head.weight
    assert _is_column_major(target.model.lm_head.weight)


def test_loaded_target_and_drafter_use_it(tiny_dirs, tmp_path):
    from conftest import load_tiny
    from hspec.drafters.checkpoint import save_drafter
    from hspec.runtime import build_drafter

    target = load_tiny(tiny_dirs["llama"])
    linears = [m for m in target.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(_is_column_major(m.weight) for m in linears)
    if target.config.tie_word_embeddings:
        assert target.model.embed_tokens.weight is target.model.lm_head.weight
    drafter = build_drafter("hspec", target, random_weights=True)
    own = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    assert own and all(_is_column_major(m.weight) for m in own)
    save_drafter(drafter, tmp_path / "d", verifier_name_or_path="tiny", verifier_architectures=["LlamaForCausalLM"])
    assert build_drafter("hspec", target, tmp_path / "d").kind == "hspec"


def test_decode_bench_verify_costs_keep_the_model(tiny_target):
    from hspec.bench.decode import VERIFY_KS, unfused_copy, verify_costs

    ratios = verify_costs(tiny_target.model, list(range(3, 20)), rounds=2)
    assert list(ratios) == list(VERIFY_KS) and all(len(v) == 2 and min(v) > 0 for v in ratios.values())
    assert tiny_target.model.layers[0].mlp.gate_up_weight is not None  # the runtime's model stays fused
    assert unfused_copy(tiny_target.model).layers[0].mlp.gate_up_weight is None
    linears = [m for m in tiny_target.model.modules() if isinstance(m, nn.Linear)]
    assert all(_is_column_major(m.weight) for m in linears)


def test_decode_bench_times_each_runners_prefill_per_length(tiny_target):
    from hspec.bench.decode import _hspec_runner, prefill_costs, render_markdown, summary

    runner = _hspec_runner(tiny_target.model, 4)
    calls: list[int] = []

    def counted(ids: list[int]) -> float:
        calls.append(len(ids))
        return runner.prefill(ids)
    ms = prefill_costs({"float32": type(runner)(runner.decode, counted)}, list(range(3, 40)), (8, 30), rounds=2)
    assert calls == [8, 30] * 3  # a warm-up round, then two timed rounds, lengths interleaved
    assert [len(v) for v in ms["float32"].values()] == [2, 2] and min(ms["float32"][30]) > 0
    from hspec.provenance import provenance

    payload = {"provenance": provenance("hspec bench decode", {"auto_dtype": "float32"}),
               "plain_decode_ms_per_token": {"float32": summary([1.0])}, "plain_decode_ratio_to_float32": {},
               "verify_over_decode": {}, "argmax_flips_8_token_vs_1_token": {}, "goals": "g",
               "prefill_ms": {"float32": {str(n): summary(v) for n, v in ms["float32"].items()}}}
    markdown = render_markdown(payload)
    assert "| P = 8 | P = 30 |" in markdown and "| hspec float32 |" in markdown


def test_fused_projections_keep_names_values_and_outputs(tiny_dirs):
    """fuse_projections: one stacked q/k/v and gate/up matrix per layer, the named weights views into it,
    state_dict unchanged, logits equal to the unfused model's (fp32 rounding of a different GEMM)."""
    import copy

    from conftest import load_tiny
    from hspec.models.layers import QKVProjection, SwiGLU
    from hspec.models.weight_layout import fuse_projections

    for family in ("llama", "qwen2"):  # qwen2 has q/k/v biases
        target = load_tiny(tiny_dirs[family])  # the loader fuses
        plain = copy.deepcopy(target.model)
        for m in plain.modules():
            if isinstance(m, QKVProjection):
                m.qkv_weight = m.qkv_bias = None
            elif isinstance(m, SwiGLU):
                m.gate_up_weight = None
        attn = target.model.layers[0].self_attn.qkv
        assert attn.qkv_weight is not None and target.model.layers[0].mlp.gate_up_weight is not None
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # a view, not a copy
        assert (attn.qkv_bias is not None) == (family == "qwen2")
        assert all(_is_column_major(w) for w in (attn.qkv_weight, attn.k_proj.weight))
        state, plain_state = target.model.state_dict(), plain.state_dict()
        assert state.keys() == plain_state.keys() and all(torch.equal(state[k], plain_state[k]) for k in state)
        ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        logits = []
        for model in (target.model, plain):
            pool = model.new_pool(num_pages=4, page_size=8)
            pool.add_sequence(0), pool.add_sequence(1)
            with torch.no_grad():
                logits.append(model(ids, pool, [0, 1]).logits)
        assert torch.allclose(logits[0], logits[1], atol=1e-5)
        fuse_projections(plain)  # the unfused copy fuses too, and matches the loaded model again
        assert torch.equal(plain.layers[0].self_attn.qkv.qkv_weight, attn.qkv_weight)


def test_fusing_trainable_weights_is_refused():
    from hspec.models.layers import SwiGLU
    from hspec.models.weight_layout import fuse_projections

    with pytest.raises(ValueError, match="frozen"):
        fuse_projections(SwiGLU(8, 16))


def test_decode_bench_counts_argmax_flips(tiny_target, tiny_dirs):
    from conftest import load_tiny
    from hspec.bench.decode import argmax_flips

    prompts = [list(range(3, 20)), list(range(5, 9))]
    flips = argmax_flips(tiny_target.model, prompts, num_tokens=20)
    assert flips["positions"] == 2 * 19 and 0 <= flips["differ"] <= 3  # fp32: near-ties only, if any
    assert flips["differ"] <= flips["logits_differ"] <= flips["positions"]
    bf16 = argmax_flips(load_tiny(tiny_dirs["llama"], dtype="bfloat16").model, prompts, num_tokens=20)
    assert bf16 == {"positions": 38, "differ": 0, "logits_differ": 0}  # the row-invariant kernels
