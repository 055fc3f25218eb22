"""The fast path's kernels: row invariance of `attend` in bf16, int8, int4 and w4a8 targets, the norms, RoPE,
and hspec's kernels' own checks (the weight formats' products: tests/test_formats.py). Greedy speculative
decoding is lossless only if a row comes out the same bits whether it is computed alone (a 1-token decode)
or inside a (K+1)-token verify; these tests check that on random tensors and on the tiny target.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hspec.cache.paged_pool import pages_for
from hspec.models.layers import attend, row_invariant
from hspec.models.native import load_kernels
from test_formats import _stored


@pytest.mark.parametrize("context", [37, 255, 700, 1023, 1024, 1500, 2100])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("t", [8, 16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])  # float32: a CPU target's pool
def test_attend_gives_a_verify_row_the_bits_of_its_decode(context, heads, kv_heads, t, kv_dtype):
    """Row r of a T-token verify sees the context and r + 1 new keys of T; its 1-token decode saw exactly
    those keys and no more. The outputs must be equal bit for bit, across value-chunk boundaries, and
    with more query rows per KV head (16 x 3) than one product takes (on an AMX CPU a 48-row product
    parted from the decode's bits at contexts from ~470 keys)."""
    torch.manual_seed(context)
    d = 64
    q = torch.randn(1, t, heads, d).to(torch.bfloat16)
    k = torch.randn(1, context + t, kv_heads, d).to(torch.bfloat16).to(kv_dtype)
    v = torch.randn(1, context + t, kv_heads, d).to(torch.bfloat16).to(kv_dtype)
    key_pos = torch.arange(context + t)
    mask = (key_pos[None, :] <= context + torch.arange(t)[:, None])[None, None]  # (1, 1, T, S)
    verify = attend(q, k, v, mask)  # (1, T, Hq * D)
    for r in range(t):
        decode = attend(q[:, r : r + 1], k[:, : context + r + 1], v[:, : context + r + 1], None)
        assert torch.equal(verify[:, r : r + 1], decode), f"row {r} differs"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_attend_keeps_a_rows_bits_behind_zero_weight_keys_at_every_length(kv_dtype):
    """A query against L keys, and against the same keys followed by 5 masked ones (a tree row's table
    ends before its siblings'), must give the same bits for every L. On an AVX2-only CPU the bf16 value
    product over a key count that is not a multiple of 16 broke this at L = 207, 331 and 343 of these, on an
    AMX CPU at L = 140, 150, 196, 205 and 355 unpadded (`_KEY_MULTIPLE` pads them)."""
    gen = torch.Generator().manual_seed(0)
    differing = []
    for length in range(1, 400):
        q = torch.randn(1, 2, 9, 64, generator=gen).to(torch.bfloat16)
        k = torch.randn(1, length + 5, 3, 64, generator=gen).to(torch.bfloat16).to(kv_dtype)
        v = torch.randn(1, length + 5, 3, 64, generator=gen).to(torch.bfloat16).to(kv_dtype)
        mask = (torch.arange(length + 5) < length).expand(1, 1, 2, length + 5)
        if not torch.equal(attend(q, k[:, :length], v[:, :length], None), attend(q, k, v, mask)):
            differing.append(length)
    assert not differing, f"key counts whose row changed behind masked keys: {differing}"


@pytest.mark.parametrize("length", [1, 31, 32, 33, 140, 205, 355, 1030])
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_attend_gives_the_same_bits_whatever_follows_its_keys(length, t, kv_dtype):
    """A paged read hands `attend` keys and values past its `num_keys` (`PagedKVPool.gather(multiple=...)`):
    whatever they hold (finite), the output must be the bits of the exact keys, for a decode row and a
    masked verify, across chunk (1,024) and key-multiple (32) boundaries."""
    from hspec.models.layers import key_multiple

    gen = torch.Generator().manual_seed(length)
    q = torch.randn(1, t, 9, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, length + 70, 3, 64, generator=gen).to(torch.bfloat16).to(kv_dtype)
    v = torch.randn(1, length + 70, 3, 64, generator=gen).to(torch.bfloat16).to(kv_dtype)
    s = length + t
    mask = None if t == 1 else (torch.arange(s) <= length + torch.arange(t)[:, None])[None, None]  # (1, 1, T, S)
    exact = attend(q, k[:, :s], v[:, :s], mask)
    for extra in (key_multiple(q) - 1, 69 - length % 7):
        assert torch.equal(attend(q, k[:, : s + extra], v[:, : s + extra], mask, num_keys=s), exact), extra
    assert key_multiple(q.float()) == 1


@pytest.mark.parametrize("context,t", [(0, 300), (37, 129), (200, 520)])
def test_a_long_prefill_gives_every_row_the_bits_it_gets_in_one_block(context, t):
    """A call of more than `_QUERY_BLOCK` tokens runs block by block against only the keys each block
    sees (ragged batch: the second sequence has 50 fewer keys); every row must keep its bits."""
    from hspec.models.layers import _QUERY_BLOCK, _attend_rows

    assert t > _QUERY_BLOCK
    torch.manual_seed(t)
    q = torch.randn(2, t, 9, 64).to(torch.bfloat16)
    k = torch.randn(2, context + t, 3, 64).to(torch.bfloat16)
    v = torch.randn(2, context + t, 3, 64).to(torch.bfloat16)
    key_pos = torch.arange(context + t)
    lengths = torch.tensor([context, max(context - 50, 0)])
    mask = key_pos[None, None, :] <= lengths[:, None, None] + torch.arange(t)[None, :, None]  # (B, T, S)
    mask = mask[:, None]
    assert torch.equal(attend(q, k, v, mask), _attend_rows(q, k, v, mask, context + t))


def _pool_layout(k: torch.Tensor) -> torch.Tensor:
    """k (B, S, Hkv, D) as a CPU target's pool holds it: K^T in memory (`PagedKVPool(transposed_k=True)`)."""
    return k.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@pytest.mark.parametrize("context,t", [(0, 1), (5, 4), (61, 8), (130, 16), (300, 3), (1000, 8), (2040, 8)])
def test_hspecs_attention_gives_a_verify_row_the_bits_of_its_decode(context, t):
    """hspec's kernel computes each row alone over the keys it may see: a verify row equals its 1-token
    decode bit for bit, with the keys in the pool's K^T layout or gathered, whatever follows them, and
    within bf16 rounding of the fused float32 attention. The verify's T x 3 rows of a KV head share its
    tiles (6 rows, 2 and 3 at the ends, several key blocks), a decode's 3 rows one tile."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(context + t)
    q = torch.randn(1, t, 9, 64).bfloat16()
    k = torch.randn(1, context + t + 40, 3, 64).bfloat16().float()
    v = torch.randn(1, context + t + 40, 3, 64).bfloat16().float()
    s = context + t
    mask = (torch.arange(s) <= context + torch.arange(t)[:, None])[None, None]  # (1, 1, T, S)
    verify = attend(q, _pool_layout(k), v, mask, num_keys=s, kernel=True)
    assert torch.equal(attend(q, k[:, :s], v[:, :s], mask, kernel=True), verify)  # gathered, exactly s keys
    for r in range(t):
        decode = attend(q[:, r : r + 1], _pool_layout(k), v, None, num_keys=context + r + 1, kernel=True)
        assert torch.equal(verify[:, r : r + 1], decode), f"row {r} differs"
    reference = attend(q.float(), k[:, :s], v[:, :s], mask)  # float32: the fused kernel
    assert (verify.float() - reference).abs().max() < 0.02


def test_hspecs_attention_gives_a_row_its_bits_at_any_thread_count():
    """With more threads than (sequence, KV head) pairs the kernel splits a head's rows into groups, each
    group reading the keys itself: every row keeps the bits it has on one thread."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(11)
    q = torch.randn(1, 8, 9, 64).bfloat16()
    k, v = torch.randn(1, 600, 3, 64).bfloat16().float(), torch.randn(1, 600, 3, 64).bfloat16().float()
    mask = (torch.arange(600) <= 592 + torch.arange(8)[:, None])[None, None]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, _pool_layout(k), v, mask, kernel=True)
        torch.set_num_threads(3)
        several = attend(q, _pool_layout(k), v, mask, kernel=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)


def test_hspecs_attention_skips_the_keys_a_row_may_not_see():
    """A row under any mask (a tree's rows see their ancestors) equals the row over its visible keys alone."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 9, 64, generator=gen).bfloat16()
    k, v = torch.randn(2, 150, 3, 64, generator=gen), torch.randn(2, 150, 3, 64, generator=gen)
    mask = torch.rand(2, 1, 3, 150, generator=gen) > 0.4
    mask[..., 0] = True
    out = attend(q, k, v, mask, kernel=True)
    for b in range(2):
        for r in range(3):
            seen = mask[b, 0, r].nonzero().squeeze(1)
            alone = attend(q[b : b + 1, r : r + 1], k[b : b + 1, seen], v[b : b + 1, seen], None, kernel=True)
            assert torch.equal(out[b : b + 1, r : r + 1], alone), (b, r)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1), (10, 2)])
def test_hspecs_attention_shares_no_sums_between_the_heads_of_a_kv_head(heads, kv_heads):
    """The rows of one KV head (its query heads, token by token) run in tiles of up to 6 rows (3 in AVX2):
    each head's rows equal that head run alone, bit for bit, and the fused float32 attention to bf16
    rounding."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(heads + kv_heads)
    q = torch.randn(2, 3, heads, 64).bfloat16()
    k, v = torch.randn(2, 77, kv_heads, 64), torch.randn(2, 77, kv_heads, 64)
    mask = (torch.arange(77) <= 74 + torch.arange(3)[:, None])[None, None].expand(2, 1, 3, 77)
    out = attend(q, _pool_layout(k), v, mask, kernel=True).unflatten(-1, (heads, 64))
    group = heads // kv_heads
    for h in range(heads):
        kv = h // group
        alone = attend(q[:, :, h : h + 1], k[:, :, kv : kv + 1], v[:, :, kv : kv + 1], mask, kernel=True)
        assert torch.equal(out[:, :, h], alone), f"head {h} differs"
    reference = attend(q.float(), k, v, mask).unflatten(-1, (heads, 64))
    assert (out.float() - reference).abs().max() < 0.02


def test_hspecs_attention_softmax_holds_scores_far_apart():
    """Scores hundreds apart (exp underflows to 0 for all but the top keys) and equal scores: the kernel's
    vectorised exp stays within bf16 rounding of the float32 softmax."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(3)
    k, v = torch.randn(1, 203, 3, 64), torch.randn(1, 203, 3, 64)
    for q in (torch.randn(1, 2, 9, 64) * 60, torch.zeros(1, 2, 9, 64)):
        got = attend(q.bfloat16(), k, v, None, kernel=True).float()
        reference = attend(q.bfloat16().float(), k, v, None)
        assert torch.isfinite(got).all()
        assert (got - reference).abs().max() < 0.02


def test_rope_and_write_rotates_and_writes_as_the_layers_do():
    """hspec::rope_and_write: the queries apply_rope gives, the rotated keys and the values written at the
    slots of a transposed float32 pool layer, bit for bit; a slot outside the pool is refused by name."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    from hspec.models.layers import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    b, t, hq, hkv, d = 2, 3, 9, 3, 64
    projected = torch.randn(b * t, (hq + 2 * hkv) * d).bfloat16()
    cos, sin = (table[:, :, None] for table in rope_cos_sin(1e4 ** -(torch.arange(0, d, 2) / d),
                                                            torch.arange(b * t).view(b, t) * 37, torch.bfloat16))
    pool_k = torch.zeros(hkv, d, 20).permute(2, 0, 1)  # (slots, Hkv, D) seen, K^T in memory
    pool_v = torch.zeros(20, hkv, d)
    slots = torch.tensor([4, 5, 6, 11, 12, 13])
    queries = torch.ops.hspec.rope_and_write(projected, cos, sin, pool_k, pool_v, slots, hq, hkv)
    heads = projected.view(b, t, hq + 2 * hkv, d)
    rotated = apply_rope(heads[:, :, : hq + hkv], cos, sin)
    assert torch.equal(queries, rotated[:, :, :hq])
    assert torch.equal(pool_k[slots], rotated[:, :, hq:].reshape(-1, hkv, d).float())
    assert torch.equal(pool_v[slots], heads[:, :, hq + hkv :].reshape(-1, hkv, d).float())
    assert not pool_k[[0, 7, 19]].any() and not pool_v[[0, 7, 19]].any()
    with pytest.raises(RuntimeError, match="slot 20 outside the pool's 20"):
        torch.ops.hspec.rope_and_write(projected, cos, sin, pool_k, pool_v, slots + 7, hq, hkv)


def test_hspecs_attention_exponentiates_within_a_few_ulp_and_underflows_to_zero():
    """Two keys, scores 0 and x, values e0 and e1: a float32 row's output holds 1 / (1 + e^x) and
    e^x / (1 + e^x), so their ratio is the kernel's e^x (to the two roundings of the output): within 4e-7
    of exp(x) from -86.9 to 0 (its polynomial: ~2 ulp), and exactly 0 below -87."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    d = 8
    x = torch.cat((torch.linspace(-86.9, 0.0, 4001), torch.tensor([-87.5, -100.0, -1e4])))
    q = torch.zeros(1, len(x), 1, d)
    q[0, :, 0, 0] = x * d**0.5
    k, v = torch.zeros(1, 2, 1, d), torch.zeros(1, 2, 1, d)
    k[0, 1, 0, 0] = 1.0
    v[0, 0, 0, 0] = v[0, 1, 0, 1] = 1.0
    out = torch.ops.hspec.attention(q, k, v, None, 2)[0].double()  # (T, D): float32 rows, no bf16 rounding
    score = (q[0, :, 0, 0] * torch.tensor(d**-0.5)).double()  # the kernel's fp32 score
    ratio = out[:, 1] / out[:, 0]
    assert ((ratio[:4001] / score[:4001].exp() - 1).abs() < 4e-7).all()
    assert (out[4001:, 1] == 0).all() and (out[4001:, 0] == 1).all()


def test_row_invariant_attention_matches_sdpa_to_bf16_rounding():
    torch.manual_seed(1)
    q = torch.randn(2, 5, 9, 64)
    k, v = torch.randn(2, 300, 3, 64), torch.randn(2, 300, 3, 64)
    mask = torch.rand(2, 1, 5, 300) > 0.3
    mask[..., 0] = True
    reference = attend(q, k, v, mask)  # float32: the fused kernel
    assert not row_invariant(q) and row_invariant(q.bfloat16())
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float()
    assert (got - reference).abs().max() < 0.05


def _norm_and_rows(dim: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A bf16 RMSNorm of `dim` with random weights and rows (2, 9, dim) whose scales span 1e-2 to 1e3."""
    from hspec.models.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(dim, 1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    return norm, (torch.randn(2, 9, dim) * torch.logspace(-2, 3, 9)[None, :, None]).bfloat16()


@pytest.mark.parametrize("dim", [64, 576, 2048])
def test_rms_norm_on_bf16_without_autograd_keeps_the_fp32_paths_bits_alone_or_among_others(dim):
    norm, x = _norm_and_rows(dim)
    with torch.no_grad():
        fast = norm(x)
        rows_alone = torch.cat([norm(x[:, t : t + 1]) for t in range(9)], 1)
    reference = norm(x)  # autograd on: the explicit fp32 path
    assert reference.requires_grad and torch.equal(fast, reference.detach()) and torch.equal(rows_alone, fast)


_OPS_ON = """
import sys, torch
from hspec.models.native import integer_capability, load_kernels
assert load_kernels()
cases = torch.load(sys.argv[1])
torch.save({"capability": integer_capability(),
            "outputs": [getattr(torch.ops.hspec, op)(*args) for op, args in cases]}, sys.argv[2])
"""


def _ops_on(capability: str, cases: list, tmp_path) -> dict:
    """hspec's operators on `cases` ((name, args) each) in a process whose HSPEC_CPU_CAPABILITY is
    `capability` (read once per process): what its kernels use there and the outputs."""
    import os
    import subprocess
    import sys

    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "HSPEC_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", _OPS_ON, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(tmp_path / "out.pt")


def test_the_vnni_tiles_give_the_avx2_tiles_bits(tmp_path):
    """With AVX512-VNNI the w4a8 and w8a8 products take vpdpbusd tiles over pairs of 8 outputs, 256-bit for 1-2
    rows and 512-bit from 3 (models/cpu_kernels.cpp): every block's integer sum is exact either way and the float
    steps are the same, so every output must equal the AVX2 tiles' bits: rows 1-13 (narrow tiles, wide ones, two
    row tiles), N / 8 even and odd (a last tile of 8 alone beside the pairs), bf16 and fp32 rows."""
    from hspec.models.native import integer_capability

    if not load_kernels() or integer_capability() != "avx512_vnni":
        pytest.skip("this CPU has no AVX512-VNNI (or hspec's kernels do not run here)")
    torch.manual_seed(5)
    cases = []
    for n, k in [(72, 96), (80, 576), (1536, 576)]:
        original = torch.randn(n, k) * 0.05
        for storage in ("w4a8 hspec", "w8a8 hspec"):
            _, scale, tiles = _stored(original, storage)
            for rows in (1, 2, 3, 4, 5, 8, 13):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(rows, k).to(dtype)
                    cases.append(("w4a8_linear", (x, tiles)) if storage == "w4a8 hspec" else
                                 ("w8a8_linear", (x, tiles, scale)))
    avx2 = _ops_on("avx2", cases, tmp_path)
    assert avx2["capability"] == "avx2"
    for (op, args), expected in zip(cases, avx2["outputs"]):
        assert torch.equal(getattr(torch.ops.hspec, op)(*args), expected), (op, tuple(args[0].shape), args[0].dtype)


def test_the_wide_attention_gives_the_avx2_attentions_bits(tmp_path):
    """Where the integer products take the VNNI tiles, the attention runs in 512-bit vectors (the scores 16
    keys and the value sums 64 outputs at a time, tiles of 6 rows): the same FMA chain per score and per
    output element and the same softmax sums, so every output must equal the AVX2 kernel's bit for bit:
    decodes and verifies without a mask, under a causal one, a tree's (random) and a padded batch's, bf16 and
    fp32 queries, up to 2,100 keys, head dims 64, 128 and 80 (80 stays in AVX2)."""
    from hspec.models.native import integer_capability

    if not load_kernels() or integer_capability() not in ("avx512_vnni", "amx_int8"):
        pytest.skip("this CPU has no AVX512-VNNI (or hspec's kernels do not run here)")
    torch.manual_seed(6)
    cases = []
    for d, t, s in [(64, 1, 300), (64, 8, 300), (80, 4, 70), (128, 3, 200), (64, 8, 2100)]:
        k, v = torch.randn(2, s + 5, 3, d), torch.randn(2, s + 5, 3, d)
        causal = torch.ones(2, 1, t, s + 5, dtype=torch.bool).tril(diagonal=s - t)
        tree = causal & (torch.rand(2, 1, t, s + 5) < 0.7)
        tree[..., 0] = True
        padded = causal.clone()
        padded[1, ..., : s // 4] = False
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(2, t, 9, d).to(dtype)
            cases += [("attention", (q, k, v, mask, s)) for mask in (None, causal, tree, padded)]
    avx2 = _ops_on("avx2", cases, tmp_path)
    for (_, args), expected in zip(cases, avx2["outputs"]):
        assert torch.equal(torch.ops.hspec.attention(*args), expected), (tuple(args[0].shape), args[0].dtype)


def test_an_unknown_cpu_capability_is_named(tmp_path):
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    tiles = _stored(torch.randn(16, 64), "w4a8 hspec")[2]
    with pytest.raises(AssertionError, match="HSPEC_CPU_CAPABILITY must be avx2 or avx512_vnni, got 'avx3'"):
        _ops_on("avx3", [("w4a8_linear", (torch.randn(1, 64), tiles))], tmp_path)


def test_hspecs_kernels_name_what_they_were_given():
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    weight, scale, packed = _stored(torch.randn(64, 64), "int4 hspec")
    with pytest.raises(RuntimeError, match=r"int4_linear: levels must be contiguous uint8 \(N, 2, 16\)"):
        torch.ops.hspec.int4_linear(torch.randn(2, 64), packed[:, :1], scale)
    with pytest.raises(RuntimeError, match="inputs in blocks of 32, got K = 48"):
        torch.ops.hspec.int8_linear(torch.randn(2, 48), torch.zeros(4, 48, dtype=torch.int8), torch.ones(4))
    tiles = _stored(torch.randn(64, 64), "w4a8 hspec")[2]
    with pytest.raises(RuntimeError, match=r"w4a8_linear: weight must be contiguous uint8 \(N / 8, 2, 160\)"):
        torch.ops.hspec.w4a8_linear(torch.randn(2, 64), tiles[:, :1])
    q, scale, tiles = _stored(torch.randn(64, 64), "w8a8 hspec")
    with pytest.raises(RuntimeError, match=r"w8a8_linear: scale must be a contiguous bf16 or fp32 \(64,\)"):
        torch.ops.hspec.w8a8_linear(torch.randn(2, 64), tiles, scale[:8])
    with pytest.raises(RuntimeError, match="rms_norm takes bfloat16"):
        torch.ops.hspec.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5)


@pytest.mark.parametrize("dim", [64, 100, 576])
def test_hspecs_rms_norm_is_f_rms_norm_to_a_bf16_step_and_keeps_a_rows_bits_alone(dim):
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    norm, x = _norm_and_rows(dim)
    with torch.no_grad():
        reference = norm(x)
        norm.kernel = True
        fast = norm(x)
        rows_alone = torch.cat([norm(x[:, t : t + 1]) for t in range(9)], 1)
    assert torch.equal(rows_alone, fast)
    step = reference.float().abs() * 2**-7  # one bf16 step of the output
    assert bool(((fast.float() - reference.float()).abs() <= step + 1e-30).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "w4a8"])
def test_tiny_target_verify_logits_equal_decode_logits_bit_for_bit(tiny_dirs, dtype):
    from conftest import load_tiny

    model = load_tiny(tiny_dirs["llama"], dtype=dtype).model
    prompt = [3 + i % (model.config.vocab_size - 3) for i in range(290)]  # crosses a value chunk while decoding
    pool = model.new_pool(num_pages=pages_for(len(prompt) + 40, 16))
    pool.add_sequence(0)
    with torch.inference_mode():
        tokens = [int(model(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1].argmax())]
        decoded = []
        for _ in range(24):
            logits = model(torch.tensor([tokens[-1:]]), pool, [0]).logits[0, -1]
            decoded.append(logits)
            tokens.append(int(logits.argmax()))
        for block in (3, 8):
            pool.truncate(0, len(prompt))
            verified = []
            for start in range(0, 24, block):
                verified.extend(model(torch.tensor([tokens[start : start + block]]), pool, [0]).logits[0])
            assert all(torch.equal(a, b) for a, b in zip(decoded, verified, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("route", ["stack", "python layers", "torch's kernels"])
def test_tiny_target_tree_rows_equal_the_decode_of_their_path_bit_for_bit(tiny_dirs, dtype, route):
    """A verified tree's node keeps the logits the decode of its path gives, with other branches' keys
    interleaved among its own in the pool: with hspec's attention kernel (in the C++ stack or the Python
    layers) every node reads the sequence's keys under the tree mask and the kernel skips those it may not
    see; with torch's kernels each node attends over its own copy of its prefix and ancestors in order."""
    from conftest import load_tiny
    from hspec.decoding.tree_verify import tree_attention_mask

    if dtype == "w4a8" and route == "torch's kernels":
        pytest.skip("w4a8 runs only in hspec's kernels")
    kernels = route != "torch's kernels"
    model = load_tiny(tiny_dirs["llama"], dtype=dtype, native=route == "stack", kernels=kernels).model
    if kernels and not model.tree_shares_keys:
        pytest.skip("hspec's CPU kernels do not run here")
    assert (model.native is not None) == (route == "stack")
    stack_calls = []
    if route == "stack":  # count the forwards that reach the compiled stack
        extension = model.native.extension
        model.native.extension = SimpleNamespace(
            decoder_stack=lambda *args: stack_calls.append(1) or extension.decoder_stack(*args))
    vocab = model.config.vocab_size
    prompt = [3 + i % (vocab - 3) for i in range(290)]  # the path crosses a value chunk
    pool = model.new_pool(num_pages=pages_for(len(prompt) + 40, 16))
    pool.add_sequence(0)
    with torch.inference_mode():
        tokens = [int(model(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1].argmax())]
        decoded = []
        for _ in range(5):
            logits = model(torch.tensor([tokens[-1:]]), pool, [0]).logits[0, -1]
            decoded.append(logits)
            tokens.append(int(logits.argmax()))
        pool.truncate(0, len(prompt))
        # [x0 ; nodes]: the path x0 -> 1 -> 3 -> 5 -> 7 carries tokens[1:5]; nodes 2, 4, 6 are siblings.
        parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 3, 5]])
        path = [0, 1, 3, 5, 7]
        ids = torch.tensor([[(t * 7 + 5) % vocab for t in range(8)]])
        ids[0, path] = torch.tensor(tokens[:5])
        before = len(stack_calls)
        tree = model(ids, pool, [0], tree_mask=tree_attention_mask(parents)).logits[0]
    assert len(stack_calls) - before == (route == "stack")  # the tree ran where the route says
    for depth, node in enumerate(path):
        assert torch.equal(tree[node], decoded[depth]), f"node {node} at depth {depth}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_smollm2_tree_rows_equal_the_decode_of_their_path_bit_for_bit(dtype):
    """The same on the real target, with 16-node trees (SpecBlock's node budget) of three children per
    level at contexts of 200-260 tokens. Before each node attended over its own keys in path order, a
    bf16 tree row summed its keys with the siblings' interleaved and parted from its decode's bits
    (3 of these 60 rows in bf16, some in int8), enough to flip greedy output at a near-tie (`hspec eval`
    caught one on Spec-Bench)."""
    from hspec.decoding.tree_verify import tree_attention_mask
    from hspec.models.loading import load_target

    target = load_target("smollm2", dtype=dtype)
    model = target.model
    prompt = target.tokenizer.encode_prompt("Summarize the history of the Roman empire, with dates. " * 16)
    pool = model.new_pool(num_pages=pages_for(len(prompt) + 80, 16))
    pool.add_sequence(0)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 1, 4, 4, 4, 7, 7, 7, 10, 10, 10]])
    path = [0, 1, 4, 7, 10]
    differing = []
    with torch.inference_mode():
        tokens = [int(model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1]
                      .argmax())]
        for rep in range(12):
            start = pool.length(0)
            decoded = []
            for _ in path:
                decoded.append(model(torch.tensor([tokens[-1:]]), pool, [0]).logits[0, -1])
                tokens.append(int(decoded[-1].argmax()))
            pool.truncate(0, start)
            ids = torch.tensor([[(i * 7919 + rep) % model.config.vocab_size for i in range(parents.shape[1])]])
            ids[0, path] = torch.tensor(tokens[-len(path) - 1 : -1])
            tree = model(ids, pool, [0], tree_mask=tree_attention_mask(parents)).logits[0]
            differing += [(rep, depth) for depth, node in enumerate(path)
                          if not torch.equal(tree[node], decoded[depth])]
            pool.truncate(0, start)
            model(torch.tensor([tokens[-len(path) - 1 : -1]]), pool, [0])  # the path's own K/V for the next rep
    assert not differing, f"tree rows with other bits than their decode (rep, depth): {differing}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_signed_sin_table_is_the_half_split_rotation_bit_for_bit(dtype):
    """`apply_rope` swaps halves against a sin table that carries the sign; it must give exactly HF Llama's
    x * cos + (-x2, x1) * sin, with 3-dim tables and with tables already broadcast over the heads."""
    from hspec.models.layers import apply_rope, rope_cos_sin

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    positions = torch.tensor([[0, 5, 300, 8191]])
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)  # (1, 4, 64)
    angles = torch.cat((positions.float()[..., None] * inv_freq,) * 2, dim=-1)
    plain_sin = angles.sin().to(dtype)
    assert torch.equal(cos, angles.cos().to(dtype))
    x = torch.randn(1, 4, 5, 64).to(dtype)
    expected = x * cos[:, :, None] + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * plain_sin[:, :, None]
    assert torch.equal(apply_rope(x, cos, sin), expected)
    assert torch.equal(apply_rope(x, cos[:, :, None], sin[:, :, None]), expected)


# A child process: calls hspec's kernels with shapes, dtypes and slots they cannot take, one line each: "raised
# <case>: <message>" or "returned <case>". Before every such call was checked, some divided by zero (SIGFPE, the
# process gone), and some wrote outside a tensor.
_BAD_CALLS = """
import torch
from hspec.models.native import load_kernels

assert load_kernels()
ops = torch.ops.hspec
bf16, f32 = torch.bfloat16, torch.float32
q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 1, 8)
cos = sin = torch.ones(1, 2, 1, 8, dtype=bf16)
projected = torch.randn(2, 4 * 8, dtype=bf16)  # 2 tokens, Hq 2 + 2 x Hkv 1 heads of D 8
cases = {
    "no kv heads": lambda: ops.attention(q, k[:, :, :0], k[:, :, :0], None, 4),
    "head dim 0": lambda: ops.attention(q[..., :0], k[..., :0], k[..., :0], None, 4),
    "no query heads": lambda: ops.attention(q[:, :, :0], k, k, None, 4),
    "mask of 2 heads": lambda: ops.attention(q, k, k, torch.ones(1, 2, 1, 4, dtype=torch.bool), 4),
    "rows of 0": lambda: ops.rms_norm(torch.randn(2, 0, dtype=bf16), torch.ones(0, dtype=bf16), 1e-5),
    "a scalar row": lambda: ops.rms_norm(torch.tensor(1.0, dtype=bf16), torch.ones(1, dtype=bf16), 1e-5),
    "short v pool": lambda: ops.rope_and_write(projected, cos, sin, torch.zeros(20, 1, 8), torch.zeros(4, 1, 8),
                                               torch.tensor([18, 19]), 2, 1),
    "hkv 0": lambda: ops.rope_and_write(projected, cos, sin, torch.zeros(20, 0, 8), torch.zeros(20, 0, 8),
                                        torch.tensor([1, 2]), 4, 0),
    "cos of D 0": lambda: ops.rope_and_write(projected[:, :0], cos[..., :0], sin[..., :0], torch.zeros(20, 1, 0),
                                             torch.zeros(20, 1, 0), torch.tensor([1, 2]), 2, 1),
}
for name, call in cases.items():
    try:
        call()
        print(f"returned {name}", flush=True)
    except RuntimeError as err:
        print(f"raised {name}: {str(err).splitlines()[0]}", flush=True)
"""


def test_hspecs_kernels_refuse_what_would_crash_the_process():
    """Each bad call raises RuntimeError naming what it was given; none kills the process or writes outside a
    tensor (run in a child, so that a crash fails this test rather than the test run)."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    src = Path(__file__).resolve().parents[1] / "src"
    child = subprocess.run([sys.executable, "-c", _BAD_CALLS], env={**os.environ, "PYTHONPATH": str(src)},
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    expected = {
        "no kv heads": "attention needs Hq, Hkv and D >= 1",
        "head dim 0": "attention needs Hq, Hkv and D >= 1",
        "no query heads": "attention needs Hq, Hkv and D >= 1",
        "mask of 2 heads": r"mask must be bool \(1, 1, 1, S >= 4\), got \[1, 2, 1, 4\]",
        "rows of 0": r"rms_norm takes rows \(\.\.\., H\) with H >= 1, got \[2, 0\]",
        "a scalar row": r"rms_norm takes rows \(\.\.\., H\) with H >= 1, got \[\]",
        "short v pool": r"the pool's layers must be both float32 or both bfloat16 CPU \(20 slots, 1, 8\), got Float "
                            r"\[4, 1, 8\]",
        "hkv 0": "rope_and_write needs hq and hkv >= 1, got hq = 4, hkv = 0",
        "cos of D 0": r"cos must be \(B, T, 1, D >= 1\), got \[1, 2, 1, 0\]",
    }
    lines = dict(line.split(" ", 1)[1].split(": ", 1) if line.startswith("raised") else (line[9:], None)
                 for line in child.stdout.splitlines())
    assert list(lines) == list(expected)
    for name, message in expected.items():
        assert lines[name] is not None and re.search(message, lines[name]), (name, lines[name])


def test_hspecs_rms_norm_reads_a_strided_weight_whole():
    """A weight that is not contiguous is copied for the loop; the copy lives as long as the loop reads it."""
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    torch.manual_seed(0)
    x = torch.randn(3, 64).bfloat16()
    weight = torch.randn(64, 2).bfloat16()[:, 0]  # every other element of a (64, 2) buffer
    assert not weight.is_contiguous()
    strided, copied = (torch.ops.hspec.rms_norm(x, w, 1e-5) for w in (weight, weight.contiguous()))
    assert torch.equal(strided, copied)
