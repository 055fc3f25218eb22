"""Paired bootstrap of relative differences."""

import numpy as np
import pytest

from hspec.eval.bootstrap import BootstrapCI, RatioOfSums, paired_bootstrap_relative_diff


def _per_prompt(n=60, seed=0):
    # Per-prompt values with a wide spread across prompts, as prompt difficulty gives.
    return np.random.default_rng(seed).uniform(1.0, 5.0, size=n)


def test_identical_systems_give_zero():
    b = _per_prompt()
    ci = paired_bootstrap_relative_diff(b.copy(), b, seed=0, num_resamples=500)
    assert ci.estimate == 0.0
    assert ci.contains(0.0)


def test_clear_difference_excludes_zero():
    b = _per_prompt()
    noise = np.random.default_rng(1).normal(0.0, 0.05, size=b.shape)
    a = b * (1.2 + noise)
    ci = paired_bootstrap_relative_diff(a, b, seed=0, num_resamples=2000)
    assert ci.estimate == pytest.approx(a.mean() / b.mean() - 1)
    assert 0.0 < ci.low < ci.estimate < ci.high
    assert ci.contains(0.2)


def test_pairing_tightens_the_interval():
    # Prompts vary 5x but A is 5% above B on every one: only a paired resample sees that clearly.
    b = _per_prompt(n=40)
    ci = paired_bootstrap_relative_diff(1.05 * b, b, seed=3, num_resamples=1000)
    assert ci.low == pytest.approx(0.05) and ci.high == pytest.approx(0.05)


def test_deterministic_given_seed():
    b = _per_prompt()
    a = _per_prompt(seed=7)
    first = paired_bootstrap_relative_diff(a, b, seed=11, num_resamples=300)
    assert paired_bootstrap_relative_diff(a, b, seed=11, num_resamples=300) == first
    assert paired_bootstrap_relative_diff(a, b, seed=12, num_resamples=300) != first


def test_ratio_of_sums():
    # τ per system = Σ emitted tokens / Σ steps over prompts.
    steps = np.array([10.0, 20.0, 30.0, 40.0])
    tau_a = RatioOfSums(numerator=np.array([30.0, 50.0, 90.0, 100.0]), denominator=steps)
    tau_b = RatioOfSums(numerator=np.array([20.0, 40.0, 60.0, 80.0]), denominator=steps)
    assert tau_a.value == pytest.approx(270 / 100)
    ci = paired_bootstrap_relative_diff(tau_a, tau_b, seed=0, num_resamples=500)
    assert ci.estimate == pytest.approx((270 / 100) / (200 / 100) - 1)
    assert ci.low <= ci.estimate <= ci.high


def test_mean_is_ratio_of_sums_with_unit_denominators():
    a, b = _per_prompt(seed=1), _per_prompt(seed=2)
    ones = np.ones_like(a)
    as_means = paired_bootstrap_relative_diff(a, b, seed=5, num_resamples=200)
    as_ratios = paired_bootstrap_relative_diff(
        RatioOfSums(a, ones), RatioOfSums(b, ones), seed=5, num_resamples=200
    )
    assert as_means == as_ratios


def test_large_inputs_are_chunked_consistently():
    # Enough prompts × resamples to need several chunks; the result must still be deterministic.
    a, b = _per_prompt(n=1500, seed=1), _per_prompt(n=1500, seed=2)
    first = paired_bootstrap_relative_diff(a, b, seed=0, num_resamples=1500)
    assert paired_bootstrap_relative_diff(a, b, seed=0, num_resamples=1500) == first


@pytest.mark.parametrize(
    "a, b, kwargs, match",
    [
        ([1.0, 2.0], [1.0, 2.0, 3.0], {}, "same prompts"),
        ([1.0], [1.0], {}, "at least 2"),
        ([1.0, 2.0], [1.0, 0.0], {}, "baseline b must be > 0"),
        ([1.0, np.nan], [1.0, 2.0], {}, "finite"),
        ([1.0, 2.0], [1.0, 2.0], {"num_resamples": 0}, "num_resamples"),
        ([1.0, 2.0], [1.0, 2.0], {"confidence": 1.0}, "confidence"),
    ],
)
def test_validation(a, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap_relative_diff(a, b, seed=0, **kwargs)


def test_ratio_and_ci_validation():
    with pytest.raises(ValueError, match="denominators must be > 0"):
        RatioOfSums(numerator=np.array([1.0, 2.0]), denominator=np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="same length"):
        RatioOfSums(numerator=np.array([1.0, 2.0]), denominator=np.array([1.0]))
    with pytest.raises(ValueError, match="low must be <= high"):
        BootstrapCI(estimate=0.0, low=0.1, high=-0.1)
