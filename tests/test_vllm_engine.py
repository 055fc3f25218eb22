"""hspec's drafters inside vLLM (CPU build, float32): greedy output equals vLLM plain, token for token;
H-Spec served by hspec's proposer keeps vLLM's KV capacity and drafts as hspec's own engine does.

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
    config = vllm_engine.resolve_export(vllm_engine.VllmDrafter("dflash", {"method": "dflash",
                                                                           "model": str(checkpoint)}),
                                        tmp_path / "exports", smollm2.path)
    outputs, drafts, dflash_capacity = _run(smollm2, config, prompts)
    assert outputs == expected
    assert drafts > 0  # DFlash drafts every step
    assert dflash_capacity < capacity  # its 5 context-KV layers share the same KV budget


def test_exported_peagle_runs_as_parallel_eagle3_and_greedy_equals_vllm_plain(smollm2, plain, tmp_path):
    """hspec's P-Eagle with random weights, exported as vLLM's parallel EAGLE-3: vLLM loads it, drafts with
    it (K drafts per step from one forward), and greedy output stays vLLM plain's."""
    prompts, expected, capacity = plain
    torch.manual_seed(0)
    drafter = create_drafter("peagle", smollm2.config, target_model=smollm2.model)
    checkpoint = save_drafter(drafter, tmp_path / "peagle", smollm2.name)
    config = vllm_engine.resolve_export(vllm_engine.VllmDrafter("peagle=PATH", {"method": "eagle3",
                                                                                "model": str(checkpoint),
                                                                                "parallel_drafting": True}),
                                        tmp_path / "exports", smollm2.path)
    assert config.speculative_config["num_speculative_tokens"] == drafter.config.max_draft_len
    outputs, drafts, peagle_capacity = _run(smollm2, config, prompts)
    assert outputs == expected
    assert drafts > 0
    assert peagle_capacity < capacity  # its 4 layers keep context K/V in the same KV budget


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
    config = vllm_engine.resolve_export(vllm_engine.VllmDrafter("dflash", {"method": "dflash",
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


def test_hspec_proposer_is_lossless_keeps_kv_and_matches_hspec_tau(smollm2, plain):
    """The shipped H-Spec drafter served by vLLM (method custom_class + hspec's plugin): greedy output equals
    vLLM plain, the KV capacity equals plain's (no drafter KV), and tau is within 5% of hspec's own engine
    on the same token ids (K = 7, its max_draft_len)."""
    from hspec.bench.vllm import hspec_engine_runs

    prompts, expected, capacity = plain
    config = vllm_engine.resolve_hspec(vllm_engine.hspec_drafter("hspec", None), smollm2.name)
    k = config.speculative_config["num_speculative_tokens"]
    vllm_engine.apply_environment(vllm_engine.cpu_environment())
    llm = vllm_engine.open_llm(smollm2.path, config, "float32", max_model_len=256)
    try:
        served = [vllm_engine.generate_greedy(llm, ids, MAX_NEW_TOKENS) for ids in prompts]
        hspec_capacity = vllm_engine.kv_capacity_tokens(llm)
    finally:
        del llm
    own = hspec_engine_runs(smollm2, "hspec", vllm_engine.hspec_checkpoint(config, smollm2.name), k, prompts,
                            MAX_NEW_TOKENS)
    assert [r.token_ids for r in served] == expected
    assert [r.token_ids for r in own] == expected
    assert hspec_capacity == capacity
    tau_vllm = 1 + sum(r.num_accepted for r in served) / sum(r.num_drafts for r in served)
    tau_hspec = 1 + sum(r.num_accepted for r in own) / sum(r.num_drafts for r in own)
    print(f"tau: vLLM + H-Spec {tau_vllm:.3f}, hspec's engine {tau_hspec:.3f}")
    assert tau_vllm > 1.5  # the trained drafter is really drafting
    assert abs(tau_vllm - tau_hspec) <= 0.05 * tau_hspec


@pytest.mark.parametrize("name", ["hspec", "hspec:0.4@6"])
def test_hspec_proposer_batched_greedy_equals_vllm_plain(smollm2, plain, name):
    """Both prompts in one batch (max_num_seqs=4): the proposer drafts for requests of different lengths
    in one call (its own rows, positions and block tables); output still equals vLLM plain at batch 1.
    A sampled request (temperature 0.8) runs too: vLLM verifies the greedy drafts without draft probabilities.
    `hspec:0.4@6`: the draft length under load (3 drafts each for the two requests, cut at confidence 0.4)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, expected, _ = plain
    config = vllm_engine.resolve_hspec(vllm_engine.parse_drafters(name, 5)[1], smollm2.name)
    vllm_engine.apply_environment(vllm_engine.cpu_environment())
    llm = vllm_engine.open_llm(smollm2.path, config, "float32", max_model_len=256, max_num_seqs=4)
    try:
        served = vllm_engine.generate_greedy_batch(llm, prompts, MAX_NEW_TOKENS)
        params = SamplingParams(temperature=0.8, seed=0, max_tokens=MAX_NEW_TOKENS)
        (sampled,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], params, use_tqdm=False)
    finally:
        del llm
    assert [r.token_ids for r in served] == expected
    assert all(r.num_drafts > 0 for r in served)
    assert len(sampled.outputs[0].token_ids) > 0


def test_hspec_auto_times_the_engines_steps_caches_the_costs_and_greedy_equals_vllm_plain(smollm2, plain, tmp_path,
                                                                                          monkeypatch):
    """`hspec:auto` on lone requests: 0, 1 and K drafts in turn until the steps are timed, then each request's
    cost-aware length; the fitted costs land in $HSPEC_CACHE/vllm_step_costs/ and the outputs stay vLLM's."""
    prompts, expected, _ = plain
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))  # the worker reads it when it builds the proposer
    config = vllm_engine.resolve_hspec(vllm_engine.parse_drafters("hspec:auto", 5)[1], smollm2.name)
    vllm_engine.apply_environment(vllm_engine.cpu_environment())
    llm = vllm_engine.open_llm(smollm2.path, config, "float32", max_model_len=256)
    try:
        served = [vllm_engine.generate_greedy(llm, ids, 2 * MAX_NEW_TOKENS) for ids in prompts]
    finally:
        del llm
    assert [r.token_ids[:MAX_NEW_TOKENS] for r in served] == expected
    assert sum(r.num_drafts for r in served) > 0
    assert len(list((tmp_path / "vllm_step_costs").glob("*.json"))) == 1
