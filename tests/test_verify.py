"""Verification and sampling: exact identities, greedy as a special case, sampled distribution."""

from __future__ import annotations

import pytest
import torch

from hspec.decoding.verify import acceptance_prob, residual_dist, verify
from hspec.sampling import SamplingParams, probs_from_logits, sample_with_uniform


def _random_dist(g, *shape):
    x = torch.rand(*shape, generator=g, dtype=torch.float64) ** 3
    x[x < 0.05] = 0.0  # include exact zeros, like top-k/top-p truncation produces
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


def test_exact_identity_of_speculative_sampling():
    """q * min(1, p/q) + (1 - beta) * residual == p, with beta = sum(q * min(1, p/q))."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        p, q = _random_dist(g, 33), _random_dist(g, 33)
        accepted_mass = q * acceptance_prob(p, q)
        beta = accepted_mass.sum()
        assert torch.allclose(accepted_mass + (1 - beta) * residual_dist(p, q), p, atol=1e-12)


def test_greedy_verification_accepts_argmax_prefix():
    logits = torch.tensor([[[0.0, 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 0]]])  # argmax 1, 0, 2, 1
    p = probs_from_logits(logits, torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long))
    drafts = torch.tensor([[1, 0, 1]])
    q = torch.nn.functional.one_hot(drafts, 3).float()
    result = verify(p, q, drafts, torch.rand(1, 3), torch.rand(1))
    assert result.num_accepted.tolist() == [2] and result.next_tokens.tolist() == [2]
    drafts = torch.tensor([[1, 0, 2]])
    result = verify(p, torch.nn.functional.one_hot(drafts, 3).float(), drafts, torch.rand(1, 3), torch.rand(1))
    assert result.num_accepted.tolist() == [3] and result.next_tokens.tolist() == [1]  # bonus


def test_sample_with_uniform_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    u = torch.linspace(0, 0.999999, 1000)
    tokens = sample_with_uniform(probs.expand(1000, 5), u)
    assert set(tokens.tolist()) == {1, 3}


def test_top_k_top_p_transform():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = probs_from_logits(logits, torch.ones(1), torch.tensor([0.7]), torch.zeros(1, dtype=torch.long))
    assert torch.allclose(p[0, 0], torch.tensor([0.625, 0.375, 0, 0]))
    p = probs_from_logits(logits, torch.ones(1), torch.ones(1), torch.tensor([3]))
    assert torch.allclose(p[0, 0], torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


def test_a_rows_distribution_does_not_depend_on_the_other_rows():
    """A sampled row's probabilities are bit-equal alone and in any batch (greedy, top-k, top-p and
    untruncated rows mixed), ties at the top-k boundary included: the engine batches requests with
    different settings, and a request's output must not change with its neighbours."""
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = (torch.randn(6, 3, vocab, generator=gen) * 4).round() / 2  # coarse values: many ties
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0])
    top_k = torch.tensor([0, 5, 0, 20, 7, 0])
    batch = probs_from_logits(logits, temperature, top_p, top_k)
    for row in range(6):
        alone = probs_from_logits(logits[row:row + 1], temperature[row:row + 1], top_p[row:row + 1],
                                  top_k[row:row + 1])
        assert torch.equal(batch[row], alone[0]), f"row {row} changed in the batch"


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_params_name_the_value(bad):
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{name}.*{value}"):
        SamplingParams(**bad)


def test_verified_token_distribution_equals_target():
    """Monte Carlo check of `verify` alone: the first emitted token is distributed as p_1.

    300k draws over 6 tokens; the test fails if any frequency is more than 5 standard errors off,
    a false-failure probability below 6 * 6e-7 (Gaussian tail, fixed seed, no reruns).
    """
    g = torch.Generator().manual_seed(1)
    V, K, N = 6, 2, 300_000
    p = _random_dist(g, K + 1, V).float()
    q = _random_dist(g, K, V).float()
    drafts = torch.stack([torch.multinomial(q[k], N, replacement=True, generator=g) for k in range(K)], 1)
    result = verify(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, torch.rand(N, K, generator=g),
                    torch.rand(N, generator=g))
    first = torch.where(result.num_accepted > 0, drafts[:, 0], result.next_tokens)
    freq = torch.bincount(first, minlength=V).double() / N
    se = (p[0].double() * (1 - p[0].double()) / N).sqrt()
    assert ((freq - p[0].double()).abs() <= 5 * se + 1e-12).all()


def test_a_row_with_n_drafts_verifies_as_a_block_of_n():
    """num_drafts n: same acceptances and next token as verifying d_1..d_n alone, whatever follows d_n."""
    g = torch.Generator().manual_seed(3)
    B, K, V = 6, 5, 11
    for _ in range(40):
        p = torch.stack([_random_dist(g, K + 1, V) for _ in range(B)]).float()
        q = torch.stack([_random_dist(g, K, V) for _ in range(B)]).float()
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
        u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
        n = torch.randint(1, K + 1, (B,), generator=g)
        got = verify(p, q, drafts, u_accept, u_sample, num_drafts=n)
        for row in range(B):
            m = int(n[row])
            alone = verify(p[row:row + 1, :m + 1], q[row:row + 1, :m], drafts[row:row + 1, :m],
                           u_accept[row:row + 1, :m], u_sample[row:row + 1])
            assert got.num_accepted[row] == alone.num_accepted[0] <= m
            assert got.next_tokens[row] == alone.next_tokens[0]


def test_full_num_drafts_changes_nothing():
    g = torch.Generator().manual_seed(4)
    p, q = _random_dist(g, 3, 5, 7).float(), _random_dist(g, 3, 4, 7).float()
    drafts = q.argmax(-1)
    u_accept, u_sample = torch.rand(3, 4, generator=g), torch.rand(3, generator=g)
    a = verify(p, q, drafts, u_accept, u_sample)
    b = verify(p, q, drafts, u_accept, u_sample, num_drafts=torch.full((3,), 4))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_tokens, b.next_tokens)


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_greedy_verification_from_logits_equals_verify_on_one_hots(k):
    """`greedy_verdict` on the target's argmaxes must give `verify`'s verdict on the one-hot distributions greedy
    rows get, ties included."""
    from hspec.decoding.verify import greedy_verdict
    from hspec.sampling import SamplingBatch, SamplingParams, greedy_tokens

    torch.manual_seed(k)
    b, v = 64, 11
    logits = torch.randint(0, 4, (b, k + 1, v)).to(torch.bfloat16)  # few values: many tied maxima
    best = logits.float().argmax(-1)
    keep = torch.rand(b, k) < 0.7  # drafts that follow the target's argmax most of the time
    drafts = torch.where(keep, best[:, :k], torch.randint(0, v, (b, k)))
    probs = SamplingBatch.from_params([SamplingParams()] * b).probs(logits)
    draft_probs = torch.zeros(b, k, v).scatter_(-1, drafts[..., None], 1.0)
    for num_drafts in (None, torch.randint(1, k + 1, (b,)) if k else None):
        expected = verify(probs, draft_probs, drafts, torch.rand(b, k), torch.rand(b), num_drafts)
        limits = [k] * b if num_drafts is None else num_drafts.tolist()
        num_accepted, next_tokens = greedy_verdict(greedy_tokens(logits).tolist(), drafts.tolist(), limits)
        assert torch.equal(torch.tensor(num_accepted), expected.num_accepted)
        assert torch.equal(torch.tensor(next_tokens), expected.next_tokens)
    assert 0 < int(expected.num_accepted.sum()) < b * max(k, 1) or k == 0
