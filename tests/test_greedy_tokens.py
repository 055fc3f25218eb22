"""`hspec::greedy_tokens` (models/cpu_kernels.cpp), the greedy argmax that `sampling.greedy_tokens` takes where hspec's
kernels are loaded: it must return `logits.float().argmax(-1)`'s index in every case, ties (the first index of
the largest value), NaNs (the first NaN), infinities and signed zeros included, or plain decoding and
verification would choose differently from the reference path.
"""

from __future__ import annotations

import pytest
import torch

from hspec.models.native import load_kernels
from hspec.sampling import greedy_tokens

pytestmark = pytest.mark.skipif(not load_kernels(), reason="hspec's CPU kernels do not run here")

# Row lengths around the kernel's vector strides (8 and 32 values) and SmolLM2's vocabulary.
_LENGTHS = [1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 1000, 49152]


def _reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", _LENGTHS)
def test_the_kernel_takes_the_first_largest_value(dtype, v):
    """Random rows, rows drawn from 3 levels (ties everywhere, the largest level often several times), rows
    of one value, of -inf, with +inf, with NaNs in different places, and -0 beside +0."""
    gen = torch.Generator().manual_seed(v)
    rows = [torch.randn(v, generator=gen) * 4, torch.randint(0, 3, (v,), generator=gen).float(),
            torch.full((v,), 1.5), torch.full((v,), -torch.inf), torch.zeros(v)]
    for _ in range(6):  # ties of the largest value at random places, and infinities and NaNs at random places
        tied = torch.randn(v, generator=gen)
        places = torch.randint(0, v, (3,), generator=gen)
        tied[places] = tied.max() + 1
        rows.append(tied)
        for special in (torch.inf, -torch.inf, torch.nan):
            row = torch.randn(v, generator=gen)
            row[torch.randint(0, v, (2,), generator=gen)] = special
            rows.append(row)
    signed_zeros = -torch.rand(v, generator=gen) - 1
    signed_zeros[torch.randint(0, v, (2,), generator=gen)] = 0.0
    signed_zeros[torch.randint(0, v, (2,), generator=gen)] = -0.0
    rows.append(signed_zeros)
    logits = torch.stack(rows).to(dtype)  # (R, V)
    assert torch.equal(torch.ops.hspec.greedy_tokens(logits), _reference(logits))
    for row in logits:  # one row alone, as a decode's
        assert torch.equal(torch.ops.hspec.greedy_tokens(row[None]), _reference(row[None]))


@pytest.mark.parametrize("shape", [(1, 1, 49152), (1, 8, 49152), (3, 5, 97), (49152,)])
def test_greedy_tokens_keeps_its_shape_and_index(shape):
    """`sampling.greedy_tokens` on (..., V) logits as decoding hands them (bf16, fp32, non-contiguous) gives the
    reference's (...) indices, as int64."""
    gen = torch.Generator().manual_seed(len(shape))
    logits = torch.randint(-3, 3, shape, generator=gen).float()  # many ties
    for view in (logits, logits.bfloat16(), logits.transpose(0, -1).contiguous().transpose(0, -1)):
        out = greedy_tokens(view)
        assert out.dtype == torch.long and out.shape == shape[:-1]
        assert torch.equal(out, _reference(view))
