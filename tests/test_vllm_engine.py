"""hspec's drafters inside vLLM (CPU build, float32): greedy output equals vLLM plain, token for token.

Needs vLLM (`bash scripts/install_vllm.sh`; the module is skipped without it) and the real SmolLM2
target (converted to a HF folder on first load). Each engine loads in 1-3 minutes on a shared 2-core
machine, so the configurations share one module-scoped set of prompts and plain outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from hspec.drafters import create_drafter  # noqa: E402
from hspec.drafters.checkpoint import save_drafter  # noqa: E402
from hspec.integrations.vllm import engine as vllm_engine  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = ("Write a short poem about the sea.", "List the numbers from 1 to 12, separated by commas.")
MAX_NEW_TOKENS = 24


def _run(target, drafter: vllm_engine.VllmDrafter, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Greedy outputs, verify steps that carried drafts, and KV capacity of one configuration."""
    vllm_engine.apply_environment(vllm_engine.cpu_environment())
    llm = vllm_engine.open_llm(target.path, drafter, "float32", max_model_len=256)
    try:
        runs = [vllm_engine.generate_greedy(llm, ids, MAX_NEW_TOKENS) for ids in prompts]
        return [r.token_ids for r in runs], sum(r.num_drafts for r in runs), vllm_engine.kv_capacity_tokens(llm)
    finally:
        del llm


@pytest.fixture(scope="module")
def plain(smollm2):
    prompts = [smollm2.tokenizer.encode_prompt(p) for p in PROMPTS]
    outputs, drafts, capacity = _run(smollm2, vllm_engine.VllmDrafter("none", None), prompts)
    assert drafts == 0 and all(len(o) > 0 for o in outputs)
    return prompts, outputs, capacity


def test_vllm_ngram_greedy_equals_vllm_plain(smollm2, plain):
    prompts, expected, capacity = plain
    outputs, drafts, ngram_capacity = _run(smollm2, vllm_engine.VllmDrafter("ngram", vllm_engine.ngram_config(4)),
                                           prompts)
    assert outputs == expected
    assert drafts > 0  # the counting prompt gives prompt lookup matches: speculation really ran
    assert ngram_capacity == capacity  # n-gram keeps no KV of its own


def test_exported_dflash_greedy_equals_vllm_plain_and_costs_kv(smollm2, plain, tmp_path):
    """Any weights keep greedy output lossless: a random-initialised hspec DFlash, exported and served."""
    prompts, expected, capacity = plain
    torch.manual_seed(0)
    drafter = create_drafter("dflash", smollm2.config, target_model=smollm2.model)
    checkpoint = save_drafter(drafter, tmp_path / "dflash", smollm2.name)
    config = vllm_engine.resolve_dflash(vllm_engine.VllmDrafter("dflash", {"method": "dflash",
                                                                           "model": str(checkpoint)}),
                                        tmp_path / "exports", smollm2.path)
    outputs, drafts, dflash_capacity = _run(smollm2, config, prompts)
    assert outputs == expected
    assert drafts > 0  # DFlash drafts every step
    assert dflash_capacity < capacity  # its 5 context-KV layers share the same KV budget


def test_plugin_drafts_from_the_anchor_as_hspec_does(smollm2, tmp_path):
    """With hspec's plugin, vLLM's DFlash reads the anchor slot as the first draft, as hspec's engine does.

    The drafter's slots are made independent (every o_proj and down_proj zero, so each slot's logits
    depend only on its own token): hspec's K-slot block and vLLM's (K+1)-slot block then draft the
    same tokens, and the accepted drafts of each prompt must match hspec's engine exactly. The anchor
    slot then drafts argmax_v lm_head[v] . norm(embed(x0)), which is x0 itself for most SmolLM2 tokens
    (digits among them), so an output that repeats a token gets accepted drafts; without the plugin
    vLLM would read the first draft from a MASK slot and accept none of them.
    """
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    torch.manual_seed(0)
    drafter = create_drafter("dflash", smollm2.config, target_model=smollm2.model)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    checkpoint = save_drafter(drafter, tmp_path / "dflash", smollm2.name)
    config = vllm_engine.resolve_dflash(vllm_engine.VllmDrafter("dflash", {"method": "dflash",
                                                                           "model": str(checkpoint)}),
                                        tmp_path / "exports", smollm2.path)
    k = config.speculative_config["num_speculative_tokens"]
    # Raw text (no chat template): the 135M model then runs into repeated tokens ("1111...").
    prompts = [smollm2.tokenizer.encode_prompt(p, raw=True) for p in
               ("la la la la la la la la la la la la la la la la", "yes yes yes yes yes yes yes yes yes yes")]

    vllm_engine.apply_environment(vllm_engine.cpu_environment())
    llm = vllm_engine.open_llm(smollm2.path, config, "float32", max_model_len=256)
    try:
        served = [vllm_engine.generate_greedy(llm, ids, MAX_NEW_TOKENS) for ids in prompts]
    finally:
        del llm
    decoder = SpeculativeDecoder(smollm2.model, build_drafter("dflash", smollm2, checkpoint), k,
                                 smollm2.config.eos_token_ids)
    own = [decoder.generate([ids], SamplingParams(), MAX_NEW_TOKENS).sequences[0] for ids in prompts]
    assert [r.token_ids for r in served] == [s.token_ids for s in own]
    assert [r.num_accepted for r in served] == [sum(s.num_accepted) for s in own]
    assert sum(r.num_accepted for r in served) > 0
