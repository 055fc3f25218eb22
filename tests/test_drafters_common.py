"""Shared pieces of trained drafters: target-layer choice, configs, the block, heads, block attention."""

from __future__ import annotations

import json

import pytest
import torch

from hspec.drafters import DRAFTERS, create_drafter, vllm_exported_kinds
from hspec.drafters.common import (
    DrafterConfig,
    MarkovHead,
    PrunedVocabHead,
    attend_block,
    build_block,
    dspark_trainable_params,
    kv_layer_of,
    select_target_layers,
)
from hspec.drafters.hspec import HSpecConfig
from hspec.models.config import RopeScaling, TargetConfig
from hspec.models.layers import attend
from hspec.registry import Registry

LLAMA31_8B = TargetConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                          RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 131072)
QWEN3_8B = TargetConfig("Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1e6, qk_norm=True)


def test_select_target_layers_reproduces_the_paper():
    assert select_target_layers(32) == (1, 8, 15, 22, 30)  # Llama-3.1-8B (App. B.1)
    assert select_target_layers(36) == (1, 9, 17, 25, 34)  # Qwen3-4B / Qwen3-8B
    assert select_target_layers(30) == (1, 7, 14, 21, 28)  # SmolLM2-135M
    assert select_target_layers(36, count=3) == (1, 17, 34)
    assert [kv_layer_of(layer) for layer in (15, 22, 30)] == [14, 21, 29]
    with pytest.raises(ValueError, match="num_layers=2"):
        select_target_layers(2)
    with pytest.raises(ValueError, match="embedding"):
        kv_layer_of(0)


def test_drafter_config_defaults_validation_and_json_round_trip():
    config = DrafterConfig.from_target("dspark", LLAMA31_8B)
    assert config.target_layers == (1, 8, 15, 22, 30) and config.draft_vocab_size == 32000
    assert (config.markov_rank, config.max_draft_len, config.sliding_window) == (256, 7, 2048)
    assert config.mask_token_id == 128256 and config.hidden_size == 4096 and config.num_kv_heads == 8
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    hspec = HSpecConfig.from_target("hspec", QWEN3_8B)
    assert HSpecConfig.from_dict(json.loads(json.dumps(hspec.to_dict()))) == hspec
    with pytest.raises(ValueError, match="target_layers"):
        DrafterConfig.from_target("dspark", LLAMA31_8B, target_layers=(1, 33))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig.from_target("dspark", LLAMA31_8B, draft_vocab_size=0)
    with pytest.raises(ValueError, match="unknown DrafterConfig fields"):
        DrafterConfig.from_dict({**config.to_dict(), "nope": 1})


def test_drafter_config_reads_the_old_name_of_max_draft_len():
    """Configs saved before the rename call the trained draft length `block_size`; they still load."""
    config = DrafterConfig.from_target("dspark", LLAMA31_8B, max_draft_len=5)
    saved = config.to_dict()
    assert "max_draft_len" in saved and "block_size" not in saved
    old = {k: v for k, v in saved.items() if k != "max_draft_len"} | {"block_size": 5}
    assert DrafterConfig.from_dict(old) == config
    with pytest.raises(ValueError, match="both 'block_size' and"):
        DrafterConfig.from_dict({**saved, "block_size": 5})


def test_dspark_param_formula_on_the_paper_targets():
    # 5 x (attention 41.9M + MLP 176.2M) + W_fc 83.9M + Markov 41.0M for Llama-3.1-8B.
    assert dspark_trainable_params(DrafterConfig.from_target("dspark", LLAMA31_8B)) == 1_215_485_184
    assert dspark_trainable_params(DrafterConfig.from_target("dspark", QWEN3_8B)) == 1_095_718_144


def test_build_block():
    block, positions = build_block(torch.tensor([5, 9]), torch.tensor([3, 10]), 4, mask_token_id=96)
    assert block.tolist() == [[5, 96, 96, 96], [9, 96, 96, 96]]
    assert positions.tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="K must be"):
        build_block(torch.tensor([5]), torch.tensor([3]), 0, 96)


def test_pruned_vocab_head_restricts_maps_back_and_saves_its_ids():
    torch.manual_seed(0)
    weight = torch.randn(12, 4)
    head = PrunedVocabHead(12, 5)
    head.attach(weight)
    ids = torch.tensor([7, 0, 11, 3, 5])
    head.set_vocab(ids)
    hidden = torch.randn(2, 3, 4)
    assert torch.allclose(head(hidden), (hidden @ weight.T)[..., ids])
    probs = torch.softmax(torch.randn(2, 3, 5), -1)
    full = head.to_full(probs)
    assert full.shape == (2, 3, 12) and torch.equal(full[..., ids], probs)
    assert full.sum(-1).allclose(torch.ones(2, 3)) and head.to_target_ids(torch.tensor([2, 4])).tolist() == [11, 5]
    # The ids are saved (a buffer); loading them refreshes the cached rows.
    other = PrunedVocabHead(12, 5)
    other.attach(weight)
    other.load_state_dict(head.state_dict())
    assert list(head.state_dict()) == ["draft_vocab_ids"] and torch.allclose(other(hidden), head(hidden))
    with pytest.raises(ValueError, match="distinct"):
        head.set_vocab(torch.tensor([1, 1, 2, 3, 4]))


def test_markov_head_starts_neutral_and_reads_the_full_vocabulary():
    head = MarkovHead(vocab_size=100, rank=8, draft_vocab_size=10)
    assert torch.equal(head(torch.tensor([[99, 0]])), torch.zeros(1, 2, 10))
    torch.nn.init.normal_(head.W2)
    out = head(torch.tensor([[99, 0, 99]]))
    assert out.shape == (1, 3, 10) and torch.equal(out[0, 0], out[0, 2])


def test_markov_head_drafts_with_int8_w2_once_stored_and_trains_with_w2():
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=100, rank=32, draft_vocab_size=48).to(torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(head.W2)
    prev = torch.tensor([[3, 99, 3]])
    exact = head(prev)  # (1, 3, 48) through W2
    head.store_int8(torch.bfloat16)
    assert head._w2_int8.weight.dtype == torch.int8 and head._w2_int8.weight.shape == (48, 32)
    drafted = head(prev)
    assert not torch.equal(drafted, exact), "the int8 copy was not used"
    assert torch.allclose(drafted.float(), exact.float(), rtol=0.05, atol=0.05 * exact.abs().max().item())
    assert torch.equal(drafted[0, 0], drafted[0, 2])  # a row is computed alike wherever it sits
    with torch.autocast("cpu", dtype=torch.bfloat16):  # training reads W2 (fp32 master weights)
        trained = MarkovHead(vocab_size=100, rank=32, draft_vocab_size=48)
        trained.store_int8(torch.bfloat16)
        trained.W2.data.normal_()
        assert trained(prev).requires_grad
    odd = MarkovHead(vocab_size=100, rank=8, draft_vocab_size=48).to(torch.bfloat16)
    odd.store_int8(torch.bfloat16)  # the int8 kernel takes no rank-8 input: W2 stays in use
    assert odd._w2_int8 is None


@pytest.mark.parametrize("causal", [True, False])
def test_attend_block_equals_sdpa_over_concatenated_keys(causal):
    torch.manual_seed(0)
    n, K, S, hq, hkv, d = 3, 4, 6, 6, 2, 8
    q, k, v = torch.randn(n, K, hq, d), torch.randn(n, K, hkv, d), torch.randn(n, K, hkv, d)
    ck, cv = torch.randn(n, S, hkv, d), torch.randn(n, S, hkv, d)
    cmask = torch.rand(n, S) > 0.3
    got = attend_block(q, k, v, (ck, cv), cmask, causal)
    block_mask = torch.ones(K, K, dtype=torch.bool).tril() if causal else torch.ones(K, K, dtype=torch.bool)
    mask = torch.cat([cmask[:, None, :].expand(n, K, S), block_mask.expand(n, K, K)], -1)[:, None]
    expected = attend(q, torch.cat([ck, k], 1), torch.cat([cv, v], 1), mask)
    assert torch.allclose(got, expected, atol=1e-5)
    no_context = attend(q, k, v, block_mask.expand(n, 1, K, K))
    assert torch.allclose(attend_block(q, k, v, None, None, causal), no_context, atol=1e-5)


def test_create_drafter_needs_the_target_model_for_trained_kinds(tiny_target):
    with pytest.raises(ValueError, match="target_model"):
        create_drafter("hspec", tiny_target.config)
    # Model-free kinds accept (and ignore) it.
    assert create_drafter("ngram", tiny_target.config, target_model=tiny_target.model).kind == "ngram"


def test_pruned_vocab_head_tries_packing_once_per_refresh():
    """Drafting calls the head every step: a weight that cannot be packed must not be re-tried each call."""
    calls = []
    head = PrunedVocabHead(12, 5, pack=lambda rows: calls.append(rows.shape) or None)
    head.attach(torch.randn(12, 4).bfloat16())
    hidden = torch.randn(1, 3, 4).bfloat16()
    first = head(hidden)
    assert torch.equal(head(hidden), first) and len(calls) == 1
    head.set_vocab(torch.tensor([7, 0, 11, 3, 5]))  # new rows: packing is tried again, once
    head(hidden)
    head(hidden)
    assert len(calls) == 2


def test_what_other_engines_run_is_declared_by_the_kind_itself_and_not_inherited():
    """vLLM serves exports of DFlash and P-Eagle, llama.cpp runs DFlash and DSpark: each declares it, and DFlash's
    other subclasses (DeLS-Spec, DFlash-2, DFly, SpecBlock) do not inherit it."""
    assert vllm_exported_kinds() == {"dflash": "dflash", "eagle3": "peagle"}
    assert {kind for kind in DRAFTERS.names() if DRAFTERS.get(kind).llama_cpp_arch} == {"dflash", "dspark"}
    assert DRAFTERS.get("dels").starts_from == ("dflash",) and DRAFTERS.get("dflash").starts_from == ()


def test_a_registry_names_a_class_and_its_presets_once():
    """A class registers under its own name and its presets' (H-Spec's ablations); a name taken twice is refused
    before anything of the second registration is kept."""
    registry = Registry("thing")

    @registry.register("a", presets=("a-small",))
    class A:
        pass

    assert registry.get("a") is registry.get("a-small") is A and (A.kind, A.presets) == ("a", ("a-small",))
    with pytest.raises(ValueError, match="'a-small' is registered twice"):
        registry.register("b", presets=("a-small",))(type("B", (), {}))
    assert registry.names() == ["a", "a-small"]
