"""H-Spec's vLLM proposer, piece by piece, without starting an engine (fast; needs vLLM's CPU ops).

- `paged_context_kv` reads back exactly what vLLM's own CPU cache writer stored, in float32 and bf16;
- `draft_rows` picks the last verified row, the anchor's position and the anchor after prefill and
  after verify steps with accepted and rejected drafts;
- the proposer's block context, built from a paged cache, gives the same drafts as hspec's engine
  reading its own pool (the shipped drafter on the real SmolLM2 target).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from hspec.cache.paged_pool import pages_for  # noqa: E402
from hspec.integrations.vllm.proposer import (  # noqa: E402
    DraftLength,
    DraftRows,
    HSpecProposer,
    VllmTargetView,
    draft_rows,
    paged_context_kv,
)

pytestmark = pytest.mark.vllm


def _write_cache(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, num_blocks: int, block_size: int
                 ) -> torch.Tensor:
    """A (nb, Hkv, bs, 2D) CPU KV cache with key/value (T, Hkv, D) written at `slots` (T,) by vLLM's own op."""
    from vllm import _custom_ops as ops

    _, hkv, d = key.shape
    cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=key.dtype)
    key_cache, value_cache = cache.view(num_blocks, hkv, 2 * block_size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_context_kv_reads_what_vllm_wrote(dtype):
    torch.manual_seed(0)
    num_blocks, block_size, hkv, d, t = 6, 32, 3, 64, 70
    key, value = torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)
    block_ids = torch.tensor([4, 1, 3])  # a request whose 3 blocks are scattered
    positions = torch.arange(t)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    cache = _write_cache(key, value, slots, num_blocks, block_size)
    wanted = torch.tensor([[5, 31, 32, 69], [0, 1, 2, 3]])  # (N=2, S=4): both rows read the same request
    k, v = paged_context_kv(cache, block_ids.expand(2, -1), wanted)
    assert torch.equal(k, key[wanted]) and torch.equal(v, value[wanted])


def test_draft_rows_after_prefill_and_verify():
    # Request 0: prefill of 5 tokens, sampled 1. Request 1: verified [x0, d1, d2, d3] at KV length 20, kept
    # d1 and a new token (1 accepted, 2 rejected). Request 2: a prefill chunk that sampled nothing.
    rows = draft_rows([[11], [21, 22], []], torch.tensor([0, 5, 9, 12]), torch.tensor([5, 20, 40]), [0, 3, 0])
    expected = DraftRows(torch.tensor([0, 1]), torch.tensor([4, 6]), torch.tensor([5, 18]), torch.tensor([11, 22]))
    for field in ("requests", "hidden_rows", "positions", "anchors"):
        assert torch.equal(getattr(rows, field), getattr(expected, field)), field


def test_block_context_from_a_paged_cache_drafts_as_hspec_does(smollm2):
    """The proposer's forward on a paged copy of hspec's pool drafts the tokens hspec's drafter drafts."""
    from types import SimpleNamespace

    from hspec.drafters.base import DraftBatch
    from hspec.runtime import build_drafter, shipped_drafter_path
    from hspec.sampling import SamplingBatch, SamplingParams

    k, block_size = 7, 32
    ids = smollm2.tokenizer.encode_prompt("List the numbers from 1 to 12, separated by commas.")
    own = build_drafter("hspec", smollm2)
    layers = own.reused_kv_layers()
    pool = smollm2.model.new_pool(num_pages=8)
    pool.add_sequence(0)
    out = smollm2.model(torch.tensor([ids]), pool, [0], hidden_layers=own.target_layers)
    own.commit(pool, [0], out.hidden, torch.tensor([len(ids)]))
    anchor = out.logits[0, -1].argmax()[None]
    batch = DraftBatch([0], anchor, [ids + [int(anchor)]], pool, SamplingBatch.from_params([SamplingParams()]),
                       [torch.Generator()])
    expected = own.propose(batch, k).draft_tokens[0].tolist()

    # The same prefix K/V in vLLM's paged layout, blocks in reverse order; the hidden states as aux outputs.
    n_blocks = pages_for(len(ids), block_size)
    block_ids = torch.arange(n_blocks).flip(0) + 1
    positions = torch.arange(len(ids))
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    table = pool.slot_table([0]).slots[0, :len(ids)]
    caches = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(
        kv_cache=_write_cache(pool.layer(i).k[table], pool.layer(i).v[table], slots, n_blocks + 1, block_size),
        isa="vec") for i in layers}
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(model=str(smollm2.path), hf_config=SimpleNamespace(
            hspec_drafter=str(shipped_drafter_path("hspec", smollm2.name)))),
        compilation_config=SimpleNamespace(static_forward_context=caches))
    proposer = HSpecProposer(vllm_config)
    vllm_model = SimpleNamespace(model=SimpleNamespace(embed_tokens=smollm2.model.embed_tokens))
    proposer.load_model(vllm_model)
    assert isinstance(VllmTargetView.of(vllm_model, smollm2.path).rope(positions[None], torch.float32)[0],
                      torch.Tensor)
    aux = list(out.hidden[0].unbind(1))  # n_sel x (T, H)
    metadata = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, len(ids)]), seq_lens=torch.tensor([len(ids)]),
                               block_table_tensor=block_ids[None].int())
    drafts = proposer.propose_with_target([[int(anchor)]], aux, metadata, None)
    assert drafts == [expected]
    # Under a budget of 0 drafts per step nothing is drafted; under a floor each row keeps a sure prefix.
    proposer.draft_length = DraftLength(k, budget=0)
    assert proposer.propose_with_target([[int(anchor)]], aux, metadata, None) == [[]]
    proposer.draft_length = DraftLength(k, confidence_floor=0.99)
    (cut,) = proposer.propose_with_target([[int(anchor)]], aux, metadata, None)
    assert 1 <= len(cut) and cut == expected[: len(cut)]
