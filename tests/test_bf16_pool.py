"""A CPU target's bfloat16 KV pool (`TargetModel.kv_dtype`): hspec's attention kernel widens each key and value
to fp32 as it reads it, so a bf16 pool gives every decode, verify, tree and prompt row, and every drafter
reading the pool, the bits a float32 pool holding the same values gives; the values are bf16 numbers already
(the row-invariant layers compute them in bf16), so nothing a model outputs changes, at half the bytes read.
"""

from __future__ import annotations

import pytest
import torch

from hspec.cache.paged_pool import PagedKVPool, pages_for, widened
from hspec.models.layers import attend
from hspec.models.native import integer_capability, load_kernels
from test_fast_path import _ops_on, _pool_layout


def _kernels() -> None:
    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")


def _bf16_exact(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).bfloat16().float()


@pytest.mark.parametrize("context,t", [(0, 1), (4, 1), (5, 4), (61, 8), (130, 16), (300, 3), (1003, 8), (2040, 8)])
def test_hspecs_attention_over_bf16_keys_gives_the_bits_of_float32_keys(context, t):
    """The same bf16-exact keys and values as float32 or bfloat16, in the pool's K^T layout or gathered, under
    a causal, a tree's or no mask: equal outputs bit for bit. Key counts that are not a multiple of 8 or 16
    take the last vector's partial (masked) loads."""
    _kernels()
    gen = torch.Generator().manual_seed(context + t)
    s = context + t
    q = torch.randn(1, t, 9, 64, generator=gen).bfloat16()
    k, v = _bf16_exact(1, s + 7, 3, 64, generator=gen), _bf16_exact(1, s + 7, 3, 64, generator=gen)
    causal = (torch.arange(s + 7) <= context + torch.arange(t)[:, None])[None, None]  # (1, 1, T, S')
    tree = causal & (torch.rand(1, 1, t, s + 7, generator=gen) < 0.8)
    tree[..., 0] = True
    for mask in (None, causal, tree):
        for keys, values in ((_pool_layout(k), v), (k, v)):
            wide = attend(q, keys, values, mask, num_keys=s, kernel=True)
            narrow = attend(q, keys.bfloat16(), values.bfloat16(), mask, num_keys=s, kernel=True)
            assert torch.equal(wide, narrow)


def test_hspecs_attention_over_a_bf16_pool_gives_a_verify_row_its_decodes_bits_at_any_thread_count():
    """At 2,000 keys of a bf16 pool (K^T in memory): each row of an 8-token verify equals its 1-token decode,
    on one thread and on three (a head's rows split into groups)."""
    _kernels()
    gen = torch.Generator().manual_seed(2000)
    context, t = 1992, 8
    q = torch.randn(1, t, 9, 64, generator=gen).bfloat16()
    k = _pool_layout(torch.randn(1, context + t + 32, 3, 64, generator=gen).bfloat16())
    v = torch.randn(1, context + t + 32, 3, 64, generator=gen).bfloat16()
    mask = (torch.arange(context + t) <= context + torch.arange(t)[:, None])[None, None]
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 3):
            torch.set_num_threads(count)
            verify = attend(q, k, v, mask, num_keys=context + t, kernel=True)
            for r in range(t):
                decode = attend(q[:, r : r + 1], k, v, None, num_keys=context + r + 1, kernel=True)
                assert torch.equal(verify[:, r : r + 1], decode), f"row {r} on {count} threads"
            outputs.append(verify)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


def test_the_wide_attention_over_bf16_keys_gives_the_avx2_attentions_bits(tmp_path):
    """The AVX-512 form widens 16 bf16 keys or values at a time (masked at the end), the AVX2 form 8 (the
    last ones through a buffer): the same values, the same FMA chains, the same bits."""
    if not load_kernels() or integer_capability() != "avx512_vnni":
        pytest.skip("this CPU has no AVX512-VNNI (or hspec's kernels do not run here)")
    gen = torch.Generator().manual_seed(7)
    cases = []
    for d, t, s in [(64, 1, 301), (64, 8, 299), (80, 4, 70), (128, 3, 203), (64, 8, 2100)]:
        k = torch.randn(2, s + 5, 3, d, generator=gen).bfloat16()
        v = torch.randn(2, s + 5, 3, d, generator=gen).bfloat16()
        causal = torch.ones(2, 1, t, s + 5, dtype=torch.bool).tril(diagonal=s - t)
        tree = causal & (torch.rand(2, 1, t, s + 5, generator=gen) < 0.7)
        tree[..., 0] = True
        q = torch.randn(2, t, 9, d, generator=gen).bfloat16()
        cases += [("attention", (q, keys, v, mask, s))
                  for mask in (None, causal, tree) for keys in (k, _pool_layout(k))]
    avx2 = _ops_on("avx2", cases, tmp_path)
    assert avx2["capability"] == "avx2"
    for (_, args), expected in zip(cases, avx2["outputs"], strict=True):
        assert torch.equal(torch.ops.hspec.attention(*args), expected), (tuple(args[0].shape), args[4])


def test_rope_and_write_stores_a_bf16_pool_the_bits_torchs_cast_gives():
    """hspec::rope_and_write into a bf16 pool's layer writes what the float32 pool gets, cast by torch
    (round to nearest even: the same numbers, since a rotated key is a bf16 value), and the same queries."""
    _kernels()
    from hspec.models.layers import rope_cos_sin

    gen = torch.Generator().manual_seed(1)
    b, t, hq, hkv, d = 1, 5, 9, 3, 64
    projected = torch.randn(b * t, (hq + 2 * hkv) * d, generator=gen).bfloat16()
    cos, sin = (table[:, :, None] for table in rope_cos_sin(1e4 ** -(torch.arange(0, d, 2) / d),
                                                            torch.arange(t).view(b, t) + 100, torch.bfloat16))
    slots = torch.tensor([3, 4, 5, 6, 9])
    written = []
    for dtype in (torch.float32, torch.bfloat16):
        pool_k, pool_v = torch.zeros(hkv, d, 12, dtype=dtype).permute(2, 0, 1), torch.zeros(12, hkv, d, dtype=dtype)
        queries = torch.ops.hspec.rope_and_write(projected, cos, sin, pool_k, pool_v, slots, hq, hkv)
        written.append((queries, pool_k, pool_v))
    (q32, k32, v32), (q16, k16, v16) = written
    assert torch.equal(q32, q16)
    assert torch.equal(k32.bfloat16(), k16) and torch.equal(v32.bfloat16(), v16)
    assert torch.equal(k16.float(), k32) and torch.equal(v16.float(), v32)  # nothing was rounded away


def test_widened_keeps_a_transposed_pools_key_layout_and_the_values():
    pool = PagedKVPool(2, num_kv_heads=3, head_dim=8, num_pages=4, page_size=4, dtype=torch.bfloat16,
                       transposed_k=True, product_dtype=torch.float32)
    pool.add_sequence(0)
    k, v = torch.randn(2, 1, 10, 3, 8).bfloat16()
    pool.write(1, pool.extend([0], 10), k, v)
    [(keys, values)], visible = pool.gather_window([1], [0], [10], window=8, multiple=4)
    assert keys.dtype == values.dtype == torch.float32 and visible.tolist() == [[True] * 8]
    assert torch.equal(keys, k[:, 2:].float()) and torch.equal(values, v[:, 2:].float())
    assert keys.permute(0, 2, 3, 1).stride(-1) == 1  # each head's K^T row-major, as the pool keeps it
    already = values.float()
    assert widened(already) is already  # a float32 pool's views are read in place
    with pytest.raises(ValueError, match="multiplied in torch.bfloat16 or float32, not torch.float16"):
        PagedKVPool(1, 1, 8, 1, dtype=torch.bfloat16, product_dtype=torch.float16)


def _float32_pool(model, num_pages: int, drafter_layers: int = 0) -> PagedKVPool:
    """The pool a row-invariant target kept before its K/V went to bf16: float32, K transposed."""
    c = model.config
    return PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_pages, 16, drafter_layers,
                       dtype=torch.float32, transposed_k=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "w4a8"])
@pytest.mark.parametrize("native", [True, False])
def test_a_target_over_its_bf16_pool_gives_the_float32_pools_logits_bit_for_bit(tiny_dirs, dtype, native):
    """Prefill, decodes, an 8-token verify and a tree over the model's own pool (bfloat16) equal the same
    forwards over a float32 pool, logits and K/V, through the C++ stack or the Python layers."""
    _kernels()
    from conftest import load_tiny
    from hspec.decoding.tree_verify import tree_attention_mask

    model = load_tiny(tiny_dirs["llama"], dtype=dtype, native=native).model
    assert model.kv_dtype == torch.bfloat16 and model.attention_kernel
    vocab = model.config.vocab_size
    prompt = [3 + (i * 5) % (vocab - 3) for i in range(300)]
    results = []
    for pool in (model.new_pool(pages_for(340, 16)), _float32_pool(model, pages_for(340, 16))):
        pool.add_sequence(0)
        with torch.inference_mode():
            logits = [model.prefill(torch.tensor([prompt]), pool, [0]).logits[0]]
            token = int(logits[0][-1].argmax())
            for _ in range(6):
                logits.append(model(torch.tensor([[token]]), pool, [0]).logits[0])
                token = int(logits[-1][-1].argmax())
            logits.append(model(torch.tensor([prompt[:8]]), pool, [0]).logits[0])
            parents = torch.tensor([[-1, 0, 0, 1, 1, 3]])
            logits.append(model(torch.tensor([prompt[10:16]]), pool, [0], tree_mask=tree_attention_mask(parents))
                          .logits[0])
        results.append((logits, pool.k[:, :322].float(), pool.v[:, :322].float()))
    (ours, k16, v16), (theirs, k32, v32) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert torch.equal(k16, k32) and torch.equal(v16, v32)


@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_a_drafter_over_a_bf16_pool_proposes_what_it_does_over_a_float32_pool(tiny_dirs, kind):
    """H-Spec reads the target's pool in place, DFlash its own layers of it: each takes its context as
    float32 (`PagedKVPool.product_dtype`), so its draft distributions over the model's bf16 pool have the bits
    they have over a float32 pool (random weights: the drafts would rarely be accepted, so the sampled
    distributions themselves are compared); and speculative decoding over the bf16 pool emits plain decoding's
    tokens."""
    _kernels()
    from conftest import load_tiny
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter
    from hspec.drafters.base import DraftBatch
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingBatch, SamplingParams

    target = load_tiny(tiny_dirs["llama"], dtype="w4a8")
    torch.manual_seed(0)
    drafter = build_drafter(kind, target, random_weights=True, precision="floating")
    decoder = SpeculativeDecoder(target.model, drafter, 3, eos_token_ids=())
    prompt = [3 + (i * 7) % (target.config.vocab_size - 3) for i in range(90)]
    own = decoder.new_pool([prompt], 24)
    assert own.k.dtype == torch.bfloat16 and own.product_dtype == torch.float32
    proposals = []
    for pool in (own, _float32_pool(target.model, own.num_pages, drafter.num_drafter_layers)):
        with torch.inference_mode():
            x0 = int(decoder.stages.prefill(pool, 0, prompt)[0].argmax())
            batch = DraftBatch([0], torch.tensor([x0]), [[*prompt, x0]], pool,
                               SamplingBatch.from_params([SamplingParams(temperature=1.0)], torch.device("cpu")),
                               [torch.Generator().manual_seed(0)])
            proposals.append(drafter.propose(batch, 3))
        drafter.release(0)
    ours, theirs = proposals
    assert torch.equal(ours.draft_tokens, theirs.draft_tokens)
    assert torch.equal(ours.draft_probs, theirs.draft_probs)
    spec = decoder.generate([prompt], SamplingParams(), 24).sequences[0].token_ids
    plain = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, eos_token_ids=())
    assert plain.generate([prompt], SamplingParams(), 24).sequences[0].token_ids == spec
