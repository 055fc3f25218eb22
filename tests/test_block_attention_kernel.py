"""hspec::block_attention (models/cpu_kernels.cpp): a drafter's block attending to [its context ; itself] in one
softmax, the context read from the pool as the pool stores it (fp32 or bf16, K^T in the pool's layout or not).

Checked against a float64 torch reference, and bit for bit against hspec::attention over the two segments laid
side by side (the same kernel's sums, which the block op reuses: each score one FMA chain, one softmax over the
seen keys, each output one FMA chain over the seen values in key order).

Legend: B batch, T block tokens, S' context keys stored, s of them read, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from hspec.models.native import integer_capability, load_kernels
from test_fast_path import _ops_on, _pool_layout

HQ, HKV, D, T = 9, 3, 64, 7


@pytest.fixture(autouse=True)
def kernels():
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")


def _inputs(b: int, s: int, kv_dtype: torch.dtype, seed: int, hidden: bool, q_dtype=torch.bfloat16):
    """q (B, T, Hq, D); a context k, v (B, s + 5, Hkv, D) whose 5 keys after the s are NaN (never to be read),
    its mask (B, s + 5) with hidden keys where `hidden`; the block's k, v (B, T, Hkv, D) in the queries' dtype."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, T, HQ, D, generator=g).to(q_dtype)
    k = torch.randn(b, s + 5, HKV, D, generator=g).to(kv_dtype)
    v = torch.randn(b, s + 5, HKV, D, generator=g).to(kv_dtype)
    k[:, s:], v[:, s:] = float("nan"), float("nan")
    mask = torch.ones(b, s + 5, dtype=torch.bool)
    if hidden:
        mask &= torch.rand(b, s + 5, generator=g) > 0.3
        mask[-1, : s // 3] = False  # a row whose first keys are hidden (a shorter sequence's, left-padded)
    mask[:, s:] = False
    block_k = torch.randn(b, T, HKV, D, generator=g).to(q_dtype)
    block_v = torch.randn(b, T, HKV, D, generator=g).to(q_dtype)
    return q, k, v, mask, block_k, block_v


def _seen(mask: torch.Tensor, s: int, causal: bool) -> torch.Tensor:
    """(B, 1, T, s + T) what each token sees of [the s context keys ; the block's T]."""
    b = mask.shape[0]
    block = torch.ones(T, T, dtype=torch.bool)
    block = block.tril() if causal else block
    return torch.cat([mask[:, None, None, :s].expand(b, 1, T, s), block.expand(b, 1, T, T)], dim=-1)


def _reference(q, k, v, mask, s, block_k, block_v, causal) -> torch.Tensor:
    """The block's attention in float64 torch: (B, T, Hq D)."""
    keys = torch.cat([k[:, :s].double(), block_k.double()], 1).repeat_interleave(HQ // HKV, dim=2)  # (B, s + T, Hq, D)
    values = torch.cat([v[:, :s].double(), block_v.double()], 1).repeat_interleave(HQ // HKV, dim=2)
    scores = torch.einsum("bthd,bjhd->bhtj", q.double(), keys) / D**0.5  # (B, Hq, T, s + T)
    scores = scores.masked_fill(~_seen(mask, s, causal), float("-inf"))
    return torch.einsum("bhtj,bjhd->bthd", torch.softmax(scores, -1), values).flatten(2)


@pytest.mark.parametrize("s", [0, 1, 5, 127, 128, 129, 300, 2049])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_is_the_attention_over_both_segments(s, kv_dtype, causal):
    """Within bf16 rounding of float64 torch; bit for bit hspec::attention over [context ; block] side by side
    (fp32), under hidden keys; the pool's K^T layout gives the same bits as K as it is; keys past the s
    (NaN) are never read."""
    for hidden in (False, True):
        q, k, v, mask, block_k, block_v = _inputs(2, s, kv_dtype, seed=s + 2 * causal + hidden, hidden=hidden)
        out = torch.ops.hspec.block_attention(q, k, v, mask, s, block_k, block_v, causal)
        assert out.shape == (2, T, HQ * D) and out.dtype == q.dtype
        reference = _reference(q, k, v, mask, s, block_k, block_v, causal)
        assert (out.double() - reference).abs().max() < 0.02, (s, kv_dtype, causal, hidden)
        side_by_side = [torch.cat([x[:, :s].float(), y.float()], 1) for x, y in ((k, block_k), (v, block_v))]
        assert torch.equal(out, torch.ops.hspec.attention(q, *side_by_side, _seen(mask, s, causal), s + T))
        assert torch.equal(out, torch.ops.hspec.block_attention(q, _pool_layout(k), v, mask, s, block_k, block_v,
                                                                causal))
    if s > 0:  # no mask: every one of the s keys seen
        everything = torch.ops.hspec.block_attention(q, k, v, None, s, block_k, block_v, causal)
        seen_all = torch.ones_like(mask)
        assert torch.equal(everything, torch.ops.hspec.block_attention(q, k, v, seen_all, s, block_k, block_v, causal))


def test_block_attention_takes_float32_queries_and_a_float32_block_over_a_bf16_context():
    """A float32 drafter over a bf16 pool: the output is float32, within float32 rounding of the reference."""
    q, k, v, mask, block_k, block_v = _inputs(1, 300, torch.bfloat16, seed=3, hidden=True, q_dtype=torch.float32)
    out = torch.ops.hspec.block_attention(q, k, v, mask, 300, block_k, block_v, True)
    assert out.dtype == torch.float32
    assert (out.double() - _reference(q, k, v, mask, 300, block_k, block_v, True)).abs().max() < 1e-4


def test_the_wide_block_attention_gives_the_avx2_bits(tmp_path):
    """The AVX-512 forms (scores 16 keys, value sums 64 outputs at a time, tiles of 6 rows) against the AVX2
    ones, bit for bit, as for hspec::attention."""
    if integer_capability() not in ("avx512_vnni", "amx_int8"):
        pytest.skip("this CPU has no AVX512-VNNI")
    cases = []
    for s, kv_dtype, causal in [(129, torch.bfloat16, True), (300, torch.float32, False),
                                (2049, torch.bfloat16, False)]:
        q, k, v, mask, block_k, block_v = _inputs(2, s, kv_dtype, seed=s, hidden=True)
        cases.append(("block_attention", (q, _pool_layout(k), v, mask, s, block_k, block_v, causal)))
    avx2 = _ops_on("avx2", cases, tmp_path)
    assert avx2["capability"] == "avx2"
    for (_, args), expected in zip(cases, avx2["outputs"], strict=True):
        assert torch.equal(torch.ops.hspec.block_attention(*args), expected), (args[4], args[1].dtype)


def test_block_attention_names_what_it_was_given():
    q, k, v, mask, block_k, block_v = _inputs(1, 10, torch.float32, seed=0, hidden=False)
    with pytest.raises(RuntimeError, match="block_k and block_v"):
        torch.ops.hspec.block_attention(q, k, v, mask, 10, block_k[:, :3], block_v, True)
    with pytest.raises(RuntimeError, match="S' >= 16"):
        torch.ops.hspec.block_attention(q, k, v, mask, 16, block_k, block_v, True)
    with pytest.raises(RuntimeError, match="context_mask must be bool"):
        torch.ops.hspec.block_attention(q, k, v, mask.int(), 10, block_k, block_v, True)
