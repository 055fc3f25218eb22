"""Paired bootstrap confidence intervals for the relative difference between two systems.

Two drafters (or a drafter and plain decoding) are run on the same prompts, so their per-prompt
results are paired: prompt difficulty moves both. Resampling prompt indices jointly keeps that
pairing, which makes the interval much tighter than resampling each system on its own
(docs/design.md#measurement: paired bootstrap 95% CIs of relative differences between drafters).

The statistic is the relative difference stat(a) / stat(b) − 1 of one of two summaries:

- the mean of per-prompt values (pass an array), e.g. per-prompt inter-token latency;
- a ratio of sums (pass `RatioOfSums`), e.g. τ = Σ (accepted + 1) over all steps / Σ steps, where
  each prompt contributes its numerator and denominator. Long prompts then weigh by their steps,
  exactly as τ over the whole set does, instead of every prompt weighing the same.

A mean is the ratio of sums with denominators of 1, so both go through one computation, and a and b
may even use different summaries. The interval is the percentile bootstrap interval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# Resamples are drawn in chunks of about this many prompt indices so memory stays bounded
# (10,000 resamples × 1,319 GSM8K prompts would be 100 MB of int64 at once). The chunk size
# depends only on the number of prompts, so results depend only on the inputs and the seed.
_INDICES_PER_CHUNK = 1 << 20


# eq=False: field-wise == on arrays has no single truth value, so equality stays identity.
@dataclass(frozen=True, eq=False)
class RatioOfSums:
    """Per-prompt numerators and denominators whose statistic is Σ numerator / Σ denominator.

    For τ: numerator[i] = Σ over prompt i's steps of (num_accepted + 1), i.e. tokens emitted;
    denominator[i] = number of steps of prompt i.
    """

    numerator: np.ndarray  # (N,) finite
    denominator: np.ndarray  # (N,) finite and > 0

    def __post_init__(self) -> None:
        numerator = np.asarray(self.numerator, dtype=np.float64)
        denominator = np.asarray(self.denominator, dtype=np.float64)
        if numerator.ndim != 1 or denominator.ndim != 1 or numerator.shape != denominator.shape:
            raise ValueError(
                f"numerator and denominator must be 1-D arrays of the same length (one entry per "
                f"prompt), got shapes {numerator.shape} and {denominator.shape}"
            )
        _check_finite("numerator", numerator)
        _check_finite("denominator", denominator)
        bad = np.flatnonzero(denominator <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"denominators must be > 0, got {denominator[i]} at prompt {i}")
        # Stored as read-only float64 copies so neither the caller nor we can change a frozen value.
        for field_name, array in (("numerator", numerator), ("denominator", denominator)):
            array = array.copy()
            array.setflags(write=False)
            object.__setattr__(self, field_name, array)

    def __len__(self) -> int:
        return int(self.numerator.shape[0])

    @property
    def value(self) -> float:
        """The statistic on all prompts: Σ numerator / Σ denominator."""
        return float(self.numerator.sum() / self.denominator.sum())


@dataclass(frozen=True)
class BootstrapCI:
    """A point estimate with its bootstrap confidence interval [low, high]."""

    estimate: float  # the statistic on the full, unresampled set of prompts
    low: float  # lower percentile bound
    high: float  # upper percentile bound
    confidence: float = 0.95  # nominal coverage of [low, high]

    def __post_init__(self) -> None:
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if not self.low <= self.high:
            raise ValueError(f"low must be <= high, got low={self.low}, high={self.high}")

    def contains(self, value: float) -> bool:
        """Whether value lies in the closed interval [low, high]."""
        return self.low <= value <= self.high

    def to_dict(self) -> dict[str, float]:
        """JSON-ready fields."""
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "confidence": self.confidence}


def paired_bootstrap_relative_diff(
    a: RatioOfSums | Sequence[float] | np.ndarray,
    b: RatioOfSums | Sequence[float] | np.ndarray,
    *,
    seed: int,
    num_resamples: int = 10_000,
    confidence: float = 0.95,
) -> BootstrapCI:
    """Paired percentile-bootstrap CI of stat(a) / stat(b) − 1.

    Args:
        a: system A per prompt: an array of values (stat = mean) or a `RatioOfSums` (stat = Σ num / Σ den).
        b: system B (the baseline) on the same prompts in the same order. Its values (or numerators)
            must all be > 0, so that its statistic is > 0 on every resample, not only on all prompts.
        seed: seed of the `np.random.default_rng` that draws the resampled prompt indices.
        num_resamples: number of bootstrap resamples.
        confidence: nominal coverage; the bounds are the (1−c)/2 and (1+c)/2 quantiles.

    Returns:
        The relative difference on all prompts and its interval; e.g. estimate 0.2 means A's
        statistic is 20% above B's.
    """
    ratio_a = _as_ratio("a", a)
    ratio_b = _as_ratio("b", b)
    if len(ratio_a) != len(ratio_b):
        raise ValueError(
            f"a and b must hold the same prompts (paired), got {len(ratio_a)} and {len(ratio_b)} entries"
        )
    n = len(ratio_a)
    if n < 2:
        raise ValueError(f"a bootstrap needs at least 2 prompts, got {n}")
    bad = np.flatnonzero(ratio_b.numerator <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"the baseline b must be > 0 for a relative difference; got {ratio_b.numerator[i]} at prompt {i}"
        )

    columns = np.stack([ratio_a.numerator, ratio_a.denominator, ratio_b.numerator, ratio_b.denominator], axis=1)
    return paired_bootstrap(columns, _relative_diff_of_ratios, seed=seed, num_resamples=num_resamples,
                            confidence=confidence)


def paired_bootstrap(
    per_prompt: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int,
    num_resamples: int = 10_000,
    confidence: float = 0.95,
) -> BootstrapCI:
    """Percentile-bootstrap CI of any statistic of per-prompt sums, resampling whole prompts.

    Args:
        per_prompt: (N, C) additive per-prompt quantities (numerators, denominators, counts) of every
            system compared; one row per prompt, so resampling rows keeps all systems paired.
        statistic: maps column sums of shape (..., C) to values of shape (...); applied to the sums
            over all prompts (the estimate) and over each resample. It must be finite on every resample.
        seed, num_resamples, confidence: as in `paired_bootstrap_relative_diff`.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if (
        isinstance(num_resamples, bool)
        or not isinstance(num_resamples, (int, np.integer))
        or num_resamples < 1
    ):
        raise ValueError(f"num_resamples must be an integer >= 1, got {num_resamples!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    per_prompt = np.asarray(per_prompt, dtype=np.float64)
    if per_prompt.ndim != 2 or per_prompt.shape[0] < 2:
        raise ValueError(f"per_prompt must be (N, C) with N >= 2 prompts, got shape {per_prompt.shape}")
    _check_finite("per_prompt", per_prompt.reshape(-1))
    n = per_prompt.shape[0]
    estimate = float(statistic(per_prompt.sum(axis=0)))

    # 1. Draw resamples of prompt indices, the same rows for every system (this is the pairing).
    # 2. For each resample, the column sums and the statistic of them.
    # 3. The interval is given by the quantiles of the resampled statistics.
    rng = np.random.default_rng(seed)
    rows_per_chunk = max(1, _INDICES_PER_CHUNK // n)
    values = np.empty(num_resamples, dtype=np.float64)
    for start in range(0, num_resamples, rows_per_chunk):
        rows = min(rows_per_chunk, num_resamples - start)
        idx = rng.integers(0, n, size=(rows, n))  # (R, N) prompt indices
        values[start : start + rows] = statistic(per_prompt[idx].sum(axis=1))  # (R, C) sums -> (R,)
    _check_finite("the statistic on a resample", values)
    alpha = 1.0 - confidence
    low, high = np.quantile(values, [alpha / 2, 1.0 - alpha / 2])
    return BootstrapCI(estimate=estimate, low=float(low), high=float(high), confidence=confidence)


def _relative_diff_of_ratios(sums: np.ndarray) -> np.ndarray:
    """(num_a / den_a) / (num_b / den_b) - 1 of column sums (..., 4)."""
    return (sums[..., 0] / sums[..., 1]) / (sums[..., 2] / sums[..., 3]) - 1.0


def _as_ratio(name: str, x: RatioOfSums | Sequence[float] | np.ndarray) -> RatioOfSums:
    """A mean of per-prompt values is the ratio of their sum to the prompt count."""
    if isinstance(x, RatioOfSums):
        return x
    values = np.asarray(x, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of per-prompt values, got shape {values.shape}")
    _check_finite(name, values)
    return RatioOfSums(numerator=values, denominator=np.ones_like(values))


def _check_finite(name: str, values: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name} must be finite, got {values[i]} at prompt {i}")
