"""The DFlash family (`dflash`, `dspark`, `dflash-kvreuse`) and P-Eagle: memory, golden, shapes, params.

Losslessness of every kind is covered by test_generate.py (parametrised over the registry).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hspec.cache.paged_pool import pages_for
from hspec.decoding.step import DecodeStages
from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.common import BlockContext, build_block, dspark_trainable_params, kv_layer_of
from hspec.drafters.dflash import DFlashConfig, DFlashDrafter, dflash_trainable_params
from hspec.drafters.peagle import peagle_trainable_params
from hspec.models.kv_accounting import known_target
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams

MINE = ("dflash", "dspark", "dflash-kvreuse", "peagle")
OWN_KV = ("dflash", "dspark", "peagle")


def _tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh_hidden(target, tokens: list[int], layers) -> torch.Tensor:
    """(1, S, n_sel, H) hidden states of `tokens` from one fresh target forward."""
    pool = target.model.new_pool(num_pages=pages_for(len(tokens), 16), page_size=16)
    pool.add_sequence(0)
    with torch.no_grad():
        return target.model(torch.tensor([tokens]), pool, [0], layers).hidden


def _run_steps(target, drafter, prompts: list[list[int]], steps: int, page_size: int = 8):
    """Prefill `prompts` and run `steps` greedy speculative steps; returns (pool, histories)."""
    stages = DecodeStages(target.model, drafter, 4, eos_token_ids=())
    pool = target.model.new_pool(64, page_size, drafter.num_drafter_layers)
    histories = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            logits = stages.prefill(pool, i, prompt)
            histories.append(list(prompt) + [int(logits.argmax(-1))])
        sampling = SamplingBatch.from_params([SamplingParams()] * len(prompts))
        generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        for _ in range(steps):
            result = stages.step(pool, list(range(len(prompts))), histories, sampling, generators)
            for h, new in zip(histories, result.new_tokens):
                h.extend(new)
    return pool, histories


# ---- parameters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "smollm2-like", "qwen3-8b", "smollm2-135m"])
def test_trainable_params_match_formulas(tiny_dirs, family):
    """dspark_trainable_params (common.py) == the real DSpark module's count; same for the others."""
    from hspec.models.loading import read_config

    config = known_target(family).config if family in ("qwen3-8b", "smollm2-135m") else read_config(tiny_dirs[family])
    with torch.device("meta"):
        target = TargetModel(config)
    for kind in MINE:
        drafter = create_drafter(kind, config, target_model=target)
        count = drafter.num_trainable_params()
        if kind == "dspark":
            assert count == dspark_trainable_params(drafter.config)
        formula = peagle_trainable_params if kind == "peagle" else dflash_trainable_params
        assert count == formula(drafter.config), kind


# ---- memory -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MINE)
def test_drafter_kv_grows_exactly_per_context_token(tiny_target, kind):
    """Pool usage by the drafter's layers grows by layers x 2 x Hkv x D x bytes per context token;
    target-KV reuse allocates no drafter layer at all."""
    c = tiny_target.config
    drafter = create_drafter(kind, c, target_model=tiny_target.model)
    expected_layers = {"dflash": 5, "dspark": 5, "peagle": drafter.config.num_layers, "dflash-kvreuse": 0}[kind]
    assert drafter.num_drafter_layers == expected_layers
    element = tiny_target.model.embed_tokens.weight.element_size()
    per_token = expected_layers * 2 * c.num_kv_heads * c.head_dim * element
    allocated, written = [], []
    lengths = (16, 32, 48)
    for n in lengths:
        pool = tiny_target.model.new_pool(8, 16, drafter.num_drafter_layers)
        tokens = _tokens(n, seed=n)
        with torch.no_grad():
            DecodeStages(tiny_target.model, drafter, 4, ()).prefill(pool, 0, tokens)
            # A proposal makes every kind finish storing its context (P-Eagle writes when it sees tokens).
            sampling = SamplingBatch.from_params([SamplingParams()])
            drafter.propose(DraftBatch([0], torch.tensor([5]), [tokens + [5]], pool, sampling,
                                       [torch.Generator()]), 2)
        L = pool.num_target_layers
        assert pool.num_drafter_layers == expected_layers and pool.k.shape[0] == L + expected_layers
        used_slots = (pool.num_pages - pool.num_free_pages) * pool.page_size
        drafter_bytes_per_slot = (pool.k[L:].nbytes + pool.v[L:].nbytes) // pool.capacity_tokens
        allocated.append(used_slots * drafter_bytes_per_slot)
        # (layer, slot) rows the drafter actually wrote, K and V.
        rows_written = sum(int((t[L:].abs().sum((-1, -2)) != 0).sum()) for t in (pool.k, pool.v))
        written.append(rows_written * c.num_kv_heads * c.head_dim * element)
        drafter.release(0)
    for n, a, w in zip(lengths, allocated, written):
        assert a == w == n * per_token
    assert (allocated[2] - allocated[0]) / (lengths[2] - lengths[0]) == per_token
    if kind == "dflash":
        assert per_token == 5 * 2 * c.num_kv_heads * c.head_dim * 4


def test_kvreuse_reads_the_selected_target_layers_in_place(tiny_target):
    drafter = create_drafter("dflash-kvreuse", tiny_target.config, target_model=tiny_target.model)
    pool = tiny_target.model.new_pool(4, 16, drafter.num_drafter_layers)
    assert drafter.target_layers == () and drafter.num_drafter_layers == 0
    assert drafter.context_pool_layers(pool) == [kv_layer_of(layer) for layer in drafter.config.target_layers]
    assert not hasattr(drafter, "fc")  # no fusion weights


# ---- golden -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", OWN_KV)
def test_pool_context_equals_context_recomputed_from_scratch(tiny_target, kind):
    """After a prefill and a few ragged speculative steps (B = 2), the drafter KV in the pool equals the
    context K/V recomputed from one fresh target forward, and so do the block logits."""
    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
    pool, histories = _run_steps(tiny_target, drafter, [_tokens(11, 1), _tokens(5, 2)], steps=4)
    with torch.no_grad():
        if kind == "peagle":  # its last commit is queued until it sees the tokens
            drafter.extend_context(pool, [0, 1], histories)
        for seq in (0, 1):
            p = pool.length(seq)
            tokens = histories[seq][:p]
            assert len(histories[seq]) == p + 1  # the history ends with the anchor x0
            hidden = _fresh_hidden(tiny_target, tokens, drafter.target_layers)  # (1, p, n_sel, H)
            positions = torch.arange(p)[None]
            if kind == "peagle":
                fresh = drafter.context_kv_from_sequence(torch.tensor([tokens]), hidden, positions)
            else:
                fresh = drafter.context_kv_from_hidden(hidden, positions)
            cached, mask = drafter.context_kv_from_pool(pool, [seq], [p])
            assert bool(mask.all()) and len(cached) == len(fresh)
            for (ck, cv), (fk, fv) in zip(cached, fresh):
                torch.testing.assert_close(ck, fk, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(cv, fv, atol=1e-4, rtol=1e-4)
            block, pos = build_block(torch.tensor([histories[seq][-1]]), torch.tensor([p]), 5,
                                     drafter.config.mask_token_id)
            from_pool = drafter.block_logits(BlockContext(block, pos, drafter.last_hidden_of([seq]), cached, mask))
            from_scratch = drafter.block_logits(BlockContext(block, pos, hidden[:, -1], fresh, mask))
            torch.testing.assert_close(from_pool, from_scratch, atol=1e-4, rtol=1e-4)


def test_training_rows_equal_inference_blocks_within_the_window(tiny_target):
    """Training's expanded whole-sequence context with per-row masks == the inference path, which
    reads the last `sliding_window` positions from the pool; gradients reach W_fc."""
    c = tiny_target.config
    config = DFlashConfig.from_target("dflash", c, sliding_window=6)
    drafter = DFlashDrafter(c, tiny_target.model, config=config)
    tokens = _tokens(24, 3)
    hidden = _fresh_hidden(tiny_target, tokens, drafter.target_layers)[0]  # (S, n_sel, H)
    s = len(tokens)
    anchors = torch.tensor([4, 9, 17])
    n = anchors.shape[0]
    pairs = drafter.context_kv_from_hidden(hidden[None], torch.arange(s)[None])  # (1, S, Hkv, D) each
    context = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in pairs]
    key_pos = torch.arange(s)
    mask = (key_pos[None] < anchors[:, None]) & (key_pos[None] >= anchors[:, None] - 6)  # (N, S)
    block, positions = build_block(torch.tensor(tokens)[anchors], anchors, 7, config.mask_token_id)
    train_logits = drafter.block_logits(BlockContext(block, positions, hidden[anchors - 1], context, mask))
    train_logits.square().mean().backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():
        for row, a in enumerate(anchors.tolist()):
            pool = tiny_target.model.new_pool(4, 16, drafter.num_drafter_layers)
            DecodeStages(tiny_target.model, drafter, 4, ()).prefill(pool, 0, tokens[:a])
            cached, cached_mask = drafter.context_kv_from_pool(pool, [0], [a])
            assert cached[0][0].shape[1] == min(a, 6)
            ctx = BlockContext(block[row:row + 1], positions[row:row + 1], drafter.last_hidden_of([0]), cached,
                               cached_mask)
            torch.testing.assert_close(drafter.block_logits(ctx), train_logits[row:row + 1].detach(),
                                       atol=1e-4, rtol=1e-4)


def test_peagle_is_causal_inside_the_draft_and_dflash_is_not(tiny_target):
    """P-Eagle's depth d sees depths <= d only, so a longer draft leaves the first depths unchanged."""
    tokens = _tokens(10, 4)
    for kind, causal in (("peagle", True), ("dflash", False)):
        drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
        pool = tiny_target.model.new_pool(4, 16, drafter.num_drafter_layers)
        with torch.no_grad():
            DecodeStages(tiny_target.model, drafter, 4, ()).prefill(pool, 0, tokens)
            if kind == "peagle":
                drafter.extend_context(pool, [0], [tokens + [7]])
            cached, mask = drafter.context_kv_from_pool(pool, [0], [len(tokens)])
            logits = []
            for K in (3, 7):
                block, pos = build_block(torch.tensor([7]), torch.tensor([len(tokens)]), K,
                                         drafter.config.mask_token_id)
                logits.append(drafter.block_logits(BlockContext(block, pos, drafter.last_hidden_of([0]), cached, mask)))
        same = torch.allclose(logits[0], logits[1][:, :3], atol=1e-5)
        assert same == causal, kind


# ---- shapes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MINE)
def test_check_target_names_both_shapes(tiny_target, kind):
    c = tiny_target.config
    drafter = create_drafter(kind, c, target_model=tiny_target.model)
    other = replace(c, num_kv_heads=1, head_dim=32)
    with pytest.raises(ValueError) as err:
        drafter.check_target(other)
    message = str(err.value)
    assert f"({c.num_kv_heads}, {c.head_dim})" in message and "(1, 32)" in message, message


def test_pool_without_drafter_layers_is_refused(tiny_target):
    drafter = create_drafter("dflash", tiny_target.config, target_model=tiny_target.model)
    pool = tiny_target.model.new_pool(4, 16, num_drafter_layers=0)
    pool.add_sequence(0)
    with pytest.raises(ValueError, match="num_drafter_layers"):
        drafter.context_pool_layers(pool)


@pytest.mark.parametrize("kind", MINE)
def test_checkpoint_round_trip(tiny_target, tmp_path, kind):
    """Saved in the Speculators format, a drafter loads back into its class with its config and weights."""
    from hspec.drafters.checkpoint import load_drafter, save_drafter

    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    loaded = load_drafter(save_drafter(drafter, tmp_path / kind, "tiny-llama"), tiny_target.model)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    assert loaded.num_drafter_layers == drafter.num_drafter_layers and loaded.target_layers == drafter.target_layers
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
