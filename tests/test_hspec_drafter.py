"""The H-Spec drafter: parameter matching, golden attention over the pool, Markov head, state
injection, O(1) per-sequence state, target checks. Losslessness is in test_generate.py (every kind)."""

from __future__ import annotations

import json

import pytest
import torch

from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.checkpoint import load_drafter, save_drafter
from hspec.drafters.common import CONTEXT_MULTIPLE, BlockContext, DrafterConfig, build_block, dspark_trainable_params
from hspec.drafters.hspec import HSpecConfig, HSpecDrafter, hspec_trainable_params
from hspec.models.config import RopeScaling, TargetConfig
from hspec.sampling import SamplingBatch, SamplingParams

HSPEC_KINDS = ["hspec", "hspec-lasttoken-only", "hspec-kvreuse-only", "hspec-nomarkov", "mamba-only",
               "attention-only"]

# name -> (target config, the paper's Mamba heads or None)
TARGETS = {
    "Qwen3-4B": (TargetConfig("Qwen3ForCausalLM", 151936, 2560, 9728, 36, 32, 8, 128, 1e-6, 1e6,
                              qk_norm=True, tie_word_embeddings=True), 44),
    "Qwen3-8B": (TargetConfig("Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1e6,
                              qk_norm=True), 48),
    "Llama-3.1-8B": (TargetConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                                  RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 131072), 56),
    "SmolLM2-135M": (TargetConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0,
                                  tie_word_embeddings=True), None),
    "tiny": (TargetConfig("LlamaForCausalLM", 96, 64, 96, 4, 4, 2, 16, 1e-5), None),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_mamba_heads_match_dspark_within_3_percent(name):
    target, paper_heads = TARGETS[name]
    config = HSpecConfig.from_target("hspec", target)
    count, budget = hspec_trainable_params(config), dspark_trainable_params(config)
    assert abs(count - budget) / budget <= 0.03, (config.mamba_nheads, count, budget)
    assert config.mamba_nheads % config.mamba_ngroups == 0
    if paper_heads is not None:  # App. B.1: 44 / 48 / 56 heads, headdim 64
        assert (config.mamba_nheads, config.mamba_headdim) == (paper_heads, 64)


@pytest.mark.parametrize("kind", HSPEC_KINDS)
@pytest.mark.parametrize("name", ["Llama-3.1-8B", "tiny"])
def test_param_formula_equals_the_module(kind, name):
    """Built on the meta device (no memory): the formula counts exactly the module's parameters."""
    target, _ = TARGETS[name]
    drafter = DRAFTERS.get(kind)(target, config=HSpecConfig.from_target(kind, target), device="meta")
    assert drafter.num_trainable_params() == hspec_trainable_params(drafter.config)


def test_ablation_configs():
    target, _ = TARGETS["Qwen3-8B"]
    c = {k: HSpecConfig.from_target(k, target) for k in HSPEC_KINDS}
    assert c["hspec"].attention_source_layers == (17, 25, 34) and c["hspec"].markov_rank == 256
    assert c["attention-only"].attention_source_layers == (1, 9, 17, 25, 34)
    assert not c["hspec-kvreuse-only"].injects and not c["hspec-lasttoken-only"].attend_target
    assert c["mamba-only"].num_attention == 0 and len(c["mamba-only"].layers) == 5
    assert all(c[k].markov_rank == 0 for k in ("mamba-only", "attention-only", "hspec-nomarkov"))
    assert len({c[k].mamba_nheads for k in HSPEC_KINDS}) == 1  # dims unchanged across ablations (B.4)


def test_the_ablations_are_presets_of_the_hspec_class(tiny_target, tmp_path):
    """Each ablation kind is the one H-Spec class built from its preset's configuration; a drafter says the kind
    it was built as, saves under it, and loads back from it, also from a checkpoint that names the subclass
    the ablation used to be (`architectures`, which loading does not read)."""
    assert sorted(k for k in DRAFTERS.names() if DRAFTERS.get(k) is HSpecDrafter) == sorted(HSPEC_KINDS)
    assert sorted(HSpecDrafter.presets) == sorted(set(HSPEC_KINDS) - {"hspec"})
    target = tiny_target
    for kind in HSPEC_KINDS:
        drafter = create_drafter(kind, target.config, target_model=target.model)
        assert type(drafter) is HSpecDrafter and drafter.kind == drafter.config.kind == kind
        assert drafter.config == HSpecConfig.from_target(kind, target.config)
    drafter = _drafter(target, "mamba-only")
    save_drafter(drafter, tmp_path / "old", "tiny")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    assert config["speculators_model_type"] == "mamba-only"
    config["architectures"] = ["MambaOnly"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path / "old", target.model)
    assert loaded.kind == "mamba-only" and loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    with pytest.raises(ValueError, match="'dflash'.*'hspec' or one of its presets"):
        HSpecDrafter(target.config, target_model=target.model,
                     config=DrafterConfig.from_target("dflash", target.config))


# ---- helpers over the tiny target -----------------------------------------------------------------


def _drafter(target, kind="hspec", seed=0, **overrides):
    torch.manual_seed(seed)
    config = HSpecConfig.from_target(kind, target.config, **overrides)
    drafter = DRAFTERS.get(kind)(target.config, target_model=target.model, config=config)
    if drafter.markov is not None:  # a trained-looking Markov head, so the correction matters
        torch.nn.init.normal_(drafter.markov.W2, std=0.5)
    return drafter.eval()


def _prefill(target, drafter, pool, seq_id, tokens):
    """Run `tokens` into the pool as the next positions of `seq_id` and commit them to the drafter."""
    if not pool.has_sequence(seq_id):
        pool.add_sequence(seq_id)
    out = target.model(torch.tensor([tokens]), pool, [seq_id], drafter.target_layers)
    drafter.commit(pool, [seq_id], out.hidden, torch.tensor([len(tokens)]))


def _context_from_scratch(target, drafter, tokens, anchor, K):
    """BlockContext for one sequence with every target K/V recomputed from a fresh full forward."""
    model = target.model
    L = target.config.num_layers
    pool = model.new_pool(num_pages=8, page_size=64)
    pool.add_sequence(0)
    out = model(torch.tensor([tokens]), pool, [0], tuple(range(L + 1)))
    hidden = out.hidden[0]  # (p, L+1, H): HF index l = the input of decoder layer l
    p = len(tokens)
    cos, sin = model.rope(torch.arange(p)[None], hidden.dtype)
    kv = []
    for layer in drafter.context_pool_layers(pool):
        block = model.layers[layer]
        _, k, v = block.self_attn.qkv(block.input_layernorm(hidden[None, :, layer]), cos, sin)
        start = max(0, p - drafter.config.sliding_window)
        kv.append((k[:, start:], v[:, start:]))
    block_tokens, positions = build_block(torch.tensor([anchor]), torch.tensor([p]), K, drafter.config.mask_token_id)
    width = kv[0][0].shape[1] if kv else 0
    return BlockContext(block_tokens, positions, hidden[p - 1, list(drafter.target_layers)][None], kv,
                        torch.ones(1, width, dtype=torch.bool))


@pytest.mark.parametrize("kind", ["hspec", "attention-only", "hspec-lasttoken-only"])
@torch.no_grad()
def test_attention_over_the_pool_equals_a_fresh_recompute(tiny_target, kind):
    """Two ragged sequences with interleaved (non-contiguous) pool pages and a sliding window that
    cuts one of them: batched block logits read from the pool equal per-sequence logits from K/V
    recomputed from scratch."""
    drafter = _drafter(tiny_target, kind, sliding_window=10)
    pool = tiny_target.model.new_pool(num_pages=16, page_size=4)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (13, 7)]
    _prefill(tiny_target, drafter, pool, 0, seqs[0][:5])
    _prefill(tiny_target, drafter, pool, 1, seqs[1][:3])
    _prefill(tiny_target, drafter, pool, 0, seqs[0][5:])
    _prefill(tiny_target, drafter, pool, 1, seqs[1][3:])
    assert pool.slot_table([0, 1]).contiguous_start is None
    anchors, K = [17, 29], 5
    lengths = pool.lengths([0, 1])
    kv, mask = drafter.context_kv_from_pool(pool, [0, 1], lengths)
    block_tokens, positions = build_block(torch.tensor(anchors), torch.tensor(lengths), K, drafter.config.mask_token_id)
    batched = drafter.block_logits(BlockContext(block_tokens, positions, drafter.last_hidden_of([0, 1]), kv, mask))
    for row in range(2):
        fresh = drafter.block_logits(_context_from_scratch(tiny_target, drafter, seqs[row], anchors[row], K))
        assert torch.allclose(batched[row], fresh[0], atol=1e-4), (kind, row)
    # A proposal's read, rounded up to CONTEXT_MULTIPLE keys with the extra ones masked, changes nothing.
    kv, mask = drafter.context_kv_from_pool(pool, [0, 1], lengths, CONTEXT_MULTIPLE)
    assert not kv or (mask.shape[1] == CONTEXT_MULTIPLE and int(mask.sum()) == 10 + 7)
    rounded = drafter.block_logits(BlockContext(block_tokens, positions, drafter.last_hidden_of([0, 1]), kv, mask))
    assert torch.allclose(rounded, batched, atol=1e-5), kind
    # A lone sequence whose pages are consecutive reads zero-copy views of the pool.
    lone = tiny_target.model.new_pool(num_pages=16, page_size=4)
    _prefill(tiny_target, drafter, lone, 0, seqs[0])
    lone_kv, lone_mask = drafter.context_kv_from_pool(lone, [0], [13])
    for k, _ in lone_kv:
        assert k.untyped_storage().data_ptr() == lone.k.untyped_storage().data_ptr()
        assert k.shape == (1, 10, 2, 16) and bool(lone_mask.all())
    lone_kv, lone_mask = drafter.context_kv_from_pool(lone, [0], [13], CONTEXT_MULTIPLE)
    assert not lone_kv or (lone_kv[0][0].shape == (1, CONTEXT_MULTIPLE, 2, 16)
                           and lone_mask.tolist() == [[True] * 10 + [False] * 22])


def _propose(target, drafter, prompts, K, params):
    pool = target.model.new_pool(num_pages=32, page_size=8)
    for i, prompt in enumerate(prompts):
        _prefill(target, drafter, pool, i, prompt)
    batch = DraftBatch(list(range(len(prompts))), torch.tensor([p[-1] for p in prompts]), prompts, pool,
                       SamplingBatch.from_params([params] * len(prompts)),
                       [torch.Generator().manual_seed(i) for i in range(len(prompts))])
    return drafter.propose(batch, K), pool


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20)])
@torch.no_grad()
def test_markov_teacher_forced_equals_the_sequential_draft(tiny_target, params):
    drafter = _drafter(tiny_target, "hspec", draft_vocab_size=60)
    drafter.head.set_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(3))[:60])
    prompts = [[1, 5, 9, 14, 3, 22, 40], [1, 7, 7, 8]]
    K = 6
    proposal, pool = _propose(tiny_target, drafter, prompts, K, params)
    ids = drafter.head.draft_vocab_ids
    assert bool(torch.isin(proposal.draft_tokens, ids).all())
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    draft_probs = proposal.probs(96)  # (B, K, V): one-hot where greedy
    assert bool((draft_probs[..., outside] == 0).all())
    # Teacher forcing with prev = [x0, d_1, ..., d_{K-1}] reproduces the sequential distributions.
    anchors = torch.tensor([p[-1] for p in prompts])
    lengths = pool.lengths([0, 1])
    kv, mask = drafter.context_kv_from_pool(pool, [0, 1], lengths)
    block_tokens, positions = build_block(anchors, torch.tensor(lengths), K, drafter.config.mask_token_id)
    ctx = BlockContext(block_tokens, positions, drafter.last_hidden_of([0, 1]), kv, mask)
    prev = torch.cat([anchors[:, None], proposal.draft_tokens[:, :-1]], 1)  # (B, K)
    logits = drafter.teacher_forced_logits(ctx, prev)
    probs = SamplingBatch.from_params([params] * 2).probs(logits)
    assert torch.allclose(drafter.head.to_full(probs), draft_probs, atol=1e-5)
    # ... and the correction matters: without it the distributions differ.
    assert not torch.allclose(SamplingBatch.from_params([params] * 2).probs(drafter.block_logits(ctx)), probs)


@torch.no_grad()
def test_state_injection_changes_the_output_and_kvreuse_only_ignores_it(tiny_target):
    for kind, matters in (("hspec", True), ("mamba-only", True), ("hspec-kvreuse-only", False)):
        drafter = _drafter(tiny_target, kind)
        ctx = _context_from_scratch(tiny_target, drafter, [1, 5, 9, 14, 3, 22], 40, 7)
        other = BlockContext(ctx.block_tokens, ctx.positions, torch.randn_like(ctx.last_hidden), ctx.context_kv,
                             ctx.context_mask)
        differs = not torch.allclose(drafter.block_logits(ctx), drafter.block_logits(other))
        assert differs == matters, kind
    s_init = _drafter(tiny_target).initial_state(ctx.last_hidden)
    c = HSpecConfig.from_target("hspec", tiny_target.config)
    assert s_init.shape == (1, c.mamba_nheads, c.mamba_headdim, c.mamba_d_state)


@torch.no_grad()
def test_nothing_grows_with_the_context(tiny_target):
    """H-Spec owns no pool layers and keeps the same per-sequence state for 16 and 200 tokens."""
    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    assert drafter.num_drafter_layers == 0
    weights = sum(t.numel() for t in drafter.state_dict().values())
    sizes = []
    for n in (16, 200):
        pool = tiny_target.model.new_pool(num_pages=16, page_size=16)
        _prefill(tiny_target, drafter, pool, 7, torch.randint(3, 96, (n,)).tolist())
        assert pool.num_drafter_layers == 0
        state = drafter.last_hidden_of([7])
        sizes.append((tuple(state.shape), len(drafter._last_hidden)))
        assert sum(t.numel() for t in drafter.state_dict().values()) == weights
        drafter.release(7)
    assert sizes[0] == sizes[1] == ((1, 5, 64), 1)
    assert not drafter._last_hidden


def test_check_target_names_both_shapes(tiny_target):
    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    c = tiny_target.config
    other = TargetConfig(c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers,
                         num_heads=4, num_kv_heads=4, head_dim=32)
    with pytest.raises(ValueError, match=r"\(Hkv, D\) = \(2, 16\).*\(Hkv, D\) = \(4, 32\)"):
        drafter.check_target(other)
    # Without target K/V reuse the KV dims do not matter, only the vocabulary and hidden size.
    create_drafter("mamba-only", c, target_model=tiny_target.model).check_target(other)
    with pytest.raises(ValueError, match=r"\(V, H\) = \(96, 64\).*\(V, H\) = \(100, 64\)"):
        drafter.check_target(TargetConfig(c.architecture, 100, 64, 96, 4, 4, 2, 16))


@torch.no_grad()
def test_state_dict_holds_only_the_drafter_and_round_trips(tiny_target):
    a = _drafter(tiny_target, seed=0)
    keys = list(a.drafter_state_dict())
    assert "head.draft_vocab_ids" in keys and "mask_embedding" in keys
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    b = _drafter(tiny_target, seed=1)
    b.load_state_dict(a.drafter_state_dict())
    ctx = _context_from_scratch(tiny_target, a, [1, 5, 9, 14], 40, 4)
    assert torch.equal(a.block_logits(ctx), b.block_logits(ctx))
    assert a.num_trainable_params() == hspec_trainable_params(a.config)
    assert all(p.requires_grad for p in a.parameters())
    assert isinstance(a.config, DrafterConfig) and isinstance(a, HSpecDrafter)


def test_block_longer_than_trained_is_refused(tiny_target):
    drafter = _drafter(tiny_target)
    with pytest.raises(ValueError, match="K must be in 1..7"):
        _propose(tiny_target, drafter, [[1, 5, 9]], 8, SamplingParams())
