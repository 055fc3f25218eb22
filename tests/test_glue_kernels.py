"""The glue kernels' vector steps (models/cpu_kernels.cpp: `rope_and_write`'s rotation and `rms_norm`'s scaling, 8
values at a time) against torch's bf16 operators, bit for bit, on rows that hold what a scalar conversion could
round differently: values near a rounding tie, subnormals, infinities, NaNs, signed zeros. Head dims and widths
that are not multiples of the vector steps take the one-at-a-time path, checked alike.
"""

from __future__ import annotations

import pytest
import torch

from hspec.models.layers import apply_rope, rope_cos_sin
from hspec.models.native import load_kernels

pytestmark = pytest.mark.skipif(not load_kernels(), reason="hspec's CPU kernels do not run here")


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bits where a value is a number, NaN where the other is (torch's vector kernels give a NaN other bits
    than c10::BFloat16's scalar conversion, which hspec's kernels keep, in their AVX2 and vector forms alike)."""
    nan = expected.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.masked_fill(nan, 0).view(torch.int16),
                                                         expected.masked_fill(nan, 0).view(torch.int16))


def _awkward(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 values over many exponents, with ties, subnormals, +-inf, NaN and -0 among them."""
    x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-20, 20, shape, generator=gen).float()
    flat = x.view(-1)
    specials = torch.tensor([torch.inf, -torch.inf, torch.nan, -0.0, 0.0, 1e-39, -3e-40, 3.0e38, 1.00390625])
    places = torch.randint(0, flat.numel(), (len(specials) * 2,), generator=gen)
    flat[places] = specials.repeat(2)
    return x.bfloat16()


@pytest.mark.parametrize("d", [8, 32, 64, 128])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_gives_apply_ropes_bits_on_awkward_values(d, pool_dtype):
    gen = torch.Generator().manual_seed(d)
    b, t, hq, hkv = 1, 8, 9, 3
    projected = _awkward((b * t, (hq + 2 * hkv) * d), gen)
    positions = torch.randint(0, 8192, (b, t), generator=gen)
    cos, sin = (table[:, :, None] for table in rope_cos_sin(1e4 ** -(torch.arange(0, d, 2) / d), positions,
                                                            torch.bfloat16))
    pool_k = torch.zeros(hkv, d, 16, dtype=pool_dtype).permute(2, 0, 1)  # (slots, Hkv, D), K^T in memory
    pool_v = torch.zeros(16, hkv, d, dtype=pool_dtype)
    slots = torch.arange(3, 3 + t)
    queries = torch.ops.hspec.rope_and_write(projected, cos, sin, pool_k, pool_v, slots, hq, hkv)
    heads = projected.view(b, t, hq + 2 * hkv, d)
    rotated = apply_rope(heads[:, :, : hq + hkv], cos, sin)  # torch's bf16 mul and add
    assert _same(queries, rotated[:, :, :hq])
    assert _same(pool_k[slots].bfloat16(), rotated[:, :, hq:].reshape(-1, hkv, d))  # a pool holds bf16 exactly
    assert _same(pool_v[slots].bfloat16(), heads[:, :, hq + hkv :].reshape(-1, hkv, d))


@pytest.mark.parametrize("h", [5, 8, 64, 100, 576])
def test_rms_norm_scales_each_value_as_its_two_bf16_steps(h):
    """out = bf16(w * bf16(x * inverse)), inverse = 1 / sqrt(mean(x^2) + eps) in fp32: rows of small integers
    times a power of two have an exact sum of squares in any order, so torch's fp32 steps give the kernel's
    inverse; the weights hold the awkward values."""
    gen = torch.Generator().manual_seed(h)
    rows = (torch.randint(-7, 8, (6, h), generator=gen).float() * 2.0 ** torch.randint(-30, 30, (6, 1),
                                                                                       generator=gen).float())
    rows[0] = 0.0  # inverse 1 / sqrt(eps)
    x = rows.bfloat16()
    w = _awkward((h,), gen)
    eps = 1e-5
    got = torch.ops.hspec.rms_norm(x, w, eps)
    squares = (x.float() ** 2).sum(-1, keepdim=True)  # exact
    inverse = 1.0 / torch.sqrt(squares / h + torch.tensor(eps, dtype=torch.float32))
    normed = (x.float() * inverse).bfloat16()
    expected = (w.float() * normed.float()).bfloat16()
    assert _same(got, expected)
