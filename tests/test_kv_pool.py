"""The paged KV pool: bookkeeping, all-or-nothing growth, rollback, paged == contiguous attention."""

from __future__ import annotations

import pytest
import torch

from hspec.cache.paged_pool import PagedKVPool, PoolFullError


def test_extend_truncate_free_and_utilization():
    pool = PagedKVPool(num_target_layers=2, num_kv_heads=1, head_dim=4, num_pages=4, page_size=4)
    pool.add_sequence(0)
    slots = pool.extend([0], 6)
    assert slots.shape == (1, 6) and pool.length(0) == 6
    assert pool.utilization() == pytest.approx(0.5)
    pool.truncate(0, 3)
    assert pool.length(0) == 3 and pool.utilization() == pytest.approx(0.25)
    pool.free(0)
    assert pool.utilization() == 0.0 and not pool.has_sequence(0)


def test_full_pool_raises_and_changes_nothing():
    pool = PagedKVPool(2, 1, 4, num_pages=3, page_size=4)
    pool.add_sequence(0)
    pool.add_sequence(1)
    pool.extend([0, 1], 4)
    with pytest.raises(PoolFullError, match="need 2 pages"):
        pool.extend([0, 1], 1)
    assert pool.lengths([0, 1]) == [4, 4] and pool.num_free_pages == 1


def test_bad_truncate_bad_copy_and_unknown_sequence():
    pool = PagedKVPool(1, 1, 2, num_pages=3, page_size=2)
    pool.add_sequence(0)
    pool.extend([0], 4)
    with pytest.raises(ValueError, match="cannot truncate"):
        pool.truncate(0, 5)
    with pytest.raises(KeyError, match="sequence 5"):
        pool.length(5)
    with pytest.raises(PoolFullError, match="need 2 pages to copy sequence 0, 1 free"):
        pool.copy_sequence(0, 1)
    with pytest.raises(ValueError, match="sequence 0 is already in the pool"):
        pool.copy_sequence(0, 0)
    with pytest.raises(KeyError, match="sequence 5"):
        pool.copy_sequence(5, 6)
    assert pool.sequence_ids() == [0] and pool.num_free_pages == 1  # no copy took a page or an id


def test_capacity_from_budget_counts_drafter_layers():
    target_only = PagedKVPool.from_memory_budget(64 << 20, 30, 3, 64, page_size=16)
    with_drafter = PagedKVPool.from_memory_budget(64 << 20, 30, 3, 64, page_size=16, num_drafter_layers=5)
    assert target_only.capacity_tokens > with_drafter.capacity_tokens
    assert target_only.capacity_tokens * 30 // 35 - with_drafter.capacity_tokens < 16


def _run(model, pool, seq_ids, chunks):
    logits = []
    with torch.no_grad():
        for chunk in chunks:
            logits.append(model(chunk, pool, seq_ids).logits)
    return torch.cat(logits, 1)


def test_paged_equals_contiguous(tiny_target):
    """A sequence whose pages are scattered (interleaved with another's) gives the same logits."""
    model = tiny_target.model
    ids = torch.randint(0, tiny_target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    contiguous = model.new_pool(num_pages=12, page_size=4)
    contiguous.add_sequence(0)
    reference = _run(model, contiguous, [0], [ids[:, :10], ids[:, 10:]])
    scattered = model.new_pool(num_pages=24, page_size=4)
    scattered.add_sequence(0)
    scattered.add_sequence(1)
    other = torch.randint(0, tiny_target.config.vocab_size, (1, 5))
    pieces = []
    with torch.no_grad():
        for start in range(0, 40, 5):  # alternate growth so page tables interleave
            pieces.append(model(ids[:, start:start + 5], scattered, [0]).logits)
            model(other, scattered, [1])
    assert scattered.slot_table([0]).contiguous_start is None
    assert torch.allclose(torch.cat(pieces, 1)[:, 10:], reference[:, 10:], atol=1e-5)


def test_rollback_equals_fresh_prefill(tiny_target):
    model = tiny_target.model
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, tiny_target.config.vocab_size, (1, 21), generator=g)
    junk = torch.randint(0, tiny_target.config.vocab_size, (1, 8), generator=g)
    nxt = torch.randint(0, tiny_target.config.vocab_size, (1, 3), generator=g)
    pool = model.new_pool(num_pages=16, page_size=4)
    pool.add_sequence(0)
    with torch.no_grad():
        model(prefix, pool, [0])
        model(junk, pool, [0])  # a rejected block ...
        pool.truncate(0, 21)  # ... rolled back
        after_rollback = model(nxt, pool, [0]).logits
        fresh = model.new_pool(num_pages=16, page_size=4)
        fresh.add_sequence(0)
        expected = model(torch.cat([prefix, nxt], 1), fresh, [0]).logits[:, -3:]
    assert torch.allclose(after_rollback, expected, atol=1e-5)


def test_batched_ragged_equals_one_by_one(tiny_target):
    model = tiny_target.model
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, tiny_target.config.vocab_size, (1, n), generator=g) for n in (5, 17, 11)]
    step = torch.randint(0, tiny_target.config.vocab_size, (3, 4), generator=g)
    pool = model.new_pool(num_pages=32, page_size=4)
    singles = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            pool.add_sequence(i)
            model(p, pool, [i])
        batched = model(step, pool, [0, 1, 2]).logits
        for i, p in enumerate(prompts):
            solo = model.new_pool(num_pages=32, page_size=4)
            solo.add_sequence(0)
            model(p, solo, [0])
            singles.append(model(step[i:i + 1], solo, [0]).logits)
    assert torch.allclose(batched, torch.cat(singles, 0), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed_k", [True, False])
def test_a_pool_returns_what_was_written_and_a_transposed_one_hands_out_k_transposed_in_place(dtype, transposed_k):
    pool = PagedKVPool(2, num_kv_heads=3, head_dim=8, num_pages=4, page_size=4, dtype=dtype,
                       transposed_k=transposed_k)
    pool.add_sequence(0)
    k, v = torch.randn(2, 1, 6, 3, 8).to(dtype)
    pool.write(1, pool.extend([0], 6), k, v)
    keys, values = pool.gather(1, pool.slot_table([0]))  # (1, 6, 3, 8) each
    assert torch.equal(keys, k) and torch.equal(values, v)
    per_head_kt = keys.permute(0, 2, 3, 1)  # (B, Hkv, D, S), what the score product reads
    if transposed_k:  # K^T is row-major, no copy needed
        assert per_head_kt.stride(-1) == 1
    else:
        assert pool.k.is_contiguous()


@pytest.mark.parametrize("transposed_k", [True, False])
def test_a_copied_sequence_holds_the_sources_kv_in_every_layer_on_pages_of_its_own(transposed_k):
    pool = PagedKVPool(2, num_kv_heads=3, head_dim=8, num_pages=8, page_size=4, num_drafter_layers=1,
                       transposed_k=transposed_k)
    pool.add_sequence(0)
    slots = pool.extend([0], 6)
    written = [torch.randn(2, 1, 6, 3, 8) for _ in range(3)]
    for layer, (k, v) in enumerate(written):  # both target layers and the drafter's
        pool.write(layer, slots, k, v)
    pool.copy_sequence(0, 1)
    assert pool.length(1) == 6 and pool.num_free_pages == 4
    assert not set(pool.slot_table([1]).slots[0].tolist()) & set(slots[0].tolist())
    for layer, (k, v) in enumerate(written):
        keys, values = pool.gather(layer, pool.slot_table([1]))
        assert torch.equal(keys, k) and torch.equal(values, v)
    pool.free(0)  # the copy owns its pages
    assert torch.equal(pool.gather(2, pool.slot_table([1]))[0], written[2][0])
    pool.add_sequence(2)
    pool.copy_sequence(2, 3)  # an empty sequence copies to an empty one
    assert pool.length(3) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("kernels", [True, False])
def test_a_target_pool_is_bf16_where_hspecs_kernel_reads_it_and_transposed_where_attention_is_row_invariant(
        tiny_target, dtype, kernels):
    """bf16/int8/int4 targets on the CPU keep K/V in bfloat16 where hspec's attention kernel reads it (widening
    each value to fp32), in float32 where torch's fp32 GEMMs do (`TargetModel.kv_dtype`), with K transposed;
    either way torch products over it take float32 (`product_dtype`). A float32 target's fused attention gets
    K slot-major in float32. Their K/V values are bf16 numbers, so either pool holds what the layers computed."""
    from hspec.models.loading import build_model
    from hspec.models.native import load_kernels

    model = build_model(tiny_target.config, tiny_target.model.state_dict(), dtype, "cpu", kernels=kernels)
    pool = model.new_pool(num_pages=4, page_size=4)
    bf16_pool = dtype != "float32" and kernels and load_kernels()
    assert pool.k.dtype == pool.v.dtype == model.kv_dtype == (torch.bfloat16 if bf16_pool else torch.float32)
    assert pool.product_dtype == model.kv_product_dtype == torch.float32
    assert model.row_invariant_attention is (dtype != "float32")
    assert (pool.k.permute(0, 2, 3, 1).stride(-1) == 1) is model.row_invariant_attention  # K^T row-major


def test_gather_rounds_the_positions_up_to_a_multiple_where_the_pool_has_them():
    """A lone sequence's read runs on into the slots after it (a view: no copy), a gather pads with slot
    0; at the end of the pool a view stops at the sequence's last position. The first S positions are
    always the sequence's own."""
    pool = PagedKVPool(1, num_kv_heads=2, head_dim=4, num_pages=6, page_size=4, dtype=torch.bfloat16)
    pool.add_sequence(0)
    k, v = torch.randn(2, 1, 6, 2, 4).to(torch.bfloat16)
    pool.write(0, pool.extend([0], 6), k, v)
    keys, values = pool.gather(0, pool.slot_table([0]), multiple=8)
    assert keys.shape[1] == values.shape[1] == 8
    assert torch.equal(keys[:, :6], k) and torch.equal(values[:, :6], v)
    assert values.data_ptr() == pool.v[0].data_ptr()  # a view into the pool
    pool.add_sequence(1)
    pool.write(0, pool.extend([1], 3), *torch.randn(2, 1, 3, 2, 4).to(torch.bfloat16))
    pool.write(0, pool.extend([0], 4), *torch.randn(2, 1, 4, 2, 4).to(torch.bfloat16))  # pages 0, 1, 3
    table = pool.slot_table([0])
    assert table.contiguous_start is None
    keys, values = pool.gather(0, table, multiple=8)  # 10 positions -> 16, the 6 after them from slot 0
    assert keys.shape[1] == 16 and torch.equal(values[:, 10:], pool.v[0, :1].expand(6, -1, -1)[None])
    assert torch.equal(pool.gather(0, table)[1], values[:, :10])
    end = PagedKVPool(1, num_kv_heads=2, head_dim=4, num_pages=2, page_size=4, dtype=torch.bfloat16)
    end.add_sequence(0)
    end.extend([0], 6)
    assert end.gather(0, end.slot_table([0]), multiple=16)[0].shape[1] == 6


def test_gather_window_rounds_up_with_the_extra_keys_masked():
    pool = PagedKVPool(1, num_kv_heads=2, head_dim=4, num_pages=8, page_size=4, dtype=torch.bfloat16)
    pool.add_sequence(0)
    k, v = torch.randn(2, 1, 10, 2, 4).to(torch.bfloat16)
    pool.write(0, pool.extend([0], 10), k, v)
    [(keys, values)], visible = pool.gather_window([0], [0], [10], window=6, multiple=8)
    assert keys.shape[1] == 8 and torch.equal(keys[:, :6], k[:, 4:]) and torch.equal(values[:, :6], v[:, 4:])
    assert visible.tolist() == [[True] * 6 + [False] * 2]
    pool.add_sequence(1)
    pool.write(0, pool.extend([1], 3), *torch.randn(2, 1, 3, 2, 4).to(torch.bfloat16))
    [(keys, values)], visible = pool.gather_window([0], [0, 1], [10, 3], window=6, multiple=8)  # a gather
    assert keys.shape[:2] == (2, 8) and torch.equal(keys[:1, :6], k[:, 4:])
    assert visible.tolist() == [[True] * 6 + [False] * 2, [False] * 3 + [True] * 3 + [False] * 2]
    [(keys, _)], visible = pool.gather_window([0], [0], [10], window=6)
    assert keys.shape[1] == 6 and bool(visible.all())
    end = PagedKVPool(1, num_kv_heads=2, head_dim=4, num_pages=4, page_size=4, dtype=torch.bfloat16)
    end.add_sequence(0)
    end.extend([0], 10)  # rounded to 16 the read would end at the pool's end: K's stride (see gather_window)
    assert end.gather_window([0], [0], [10], window=16, multiple=16)[0][0][0].shape[1] == 10
