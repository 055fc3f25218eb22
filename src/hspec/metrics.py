"""Acceptance statistics of speculative decoding, computed from per-step logs.

Each decoding step of one sequence drafts K tokens and the target accepts `num_accepted` of them
(0..K), then emits one more token of its own (the correction token on a rejection, the bonus token
when all K pass; docs/design.md#the-decoding-step). Everything reported about acceptance follows from the histogram of
`num_accepted` over steps, so that histogram is the one thing `AcceptanceStats` stores:

- MAL τ = mean over steps of (num_accepted + 1), so 1 ≤ τ ≤ K+1;
- conditional acceptance at block position k (1-based) = P(num_accepted ≥ k | num_accepted ≥ k−1),
  the probability that draft k is accepted given drafts 1..k−1 were (the H-Spec paper's Fig. 4).

A drafter may verify fewer than K drafts in a step (`Proposal.num_drafts`). A step that verified
n < K drafts and accepted all n never tried position n+1, so those steps are counted apart
(`stopped_histogram`) and left out of position n+1's denominator; a step that verified none was a
plain decode and is not a speculative step at all.

Because histograms add, statistics of many sequences or runs merge exactly (`merge_stats`), with
no loss from averaging averages. The module also holds `summarize_times`, the min/median/max
summary docs/design.md#measurement asks for noisy timings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AcceptanceStats:
    """Histogram of accepted-draft counts over decoding steps, and what follows from it.

    Build one with `acceptance_stats(num_accepted, K)` from a step log, `from_histogram` from saved
    counts, or `from_dict` from `to_dict()` output. `num_steps`, `mean_accepted_length` and
    `acceptance_by_position` are derived properties, so two stats are equal exactly when their K and
    histograms are.
    """

    K: int  # draft block length (paper's K): drafts proposed per step
    # entry n = number of steps with num_accepted == n, for n = 0..K; length K+1
    accepted_count_histogram: tuple[int, ...]
    # entry n = number of steps that verified only n < K drafts and accepted all n (entries 0 and K
    # are 0); length K+1, or empty for none (every step verified K drafts)
    stopped_histogram: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.K, bool) or not isinstance(self.K, (int, np.integer)) or self.K < 1:
            raise ValueError(f"K must be an integer >= 1, got {self.K!r}")
        counts = tuple(self.accepted_count_histogram)
        if len(counts) != self.K + 1:
            raise ValueError(
                f"accepted_count_histogram must have K+1 = {self.K + 1} entries (counts of 0..K "
                f"accepted), got {len(counts)}"
            )
        for n, count in enumerate(counts):
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(
                    f"accepted_count_histogram[{n}] must be a non-negative integer, got {count!r}"
                )
        stopped = tuple(self.stopped_histogram) or (0,) * len(counts)
        if len(stopped) != len(counts) or stopped[0] or stopped[-1] or any(
                not 0 <= s <= c for s, c in zip(stopped, counts)):
            raise ValueError(
                f"stopped_histogram must have K+1 = {self.K + 1} entries, 0 at both ends, each at most the "
                f"accepted count of its n ({counts}); got {stopped}"
            )
        # Normalise to plain Python ints so equality, hashing and JSON never see numpy scalars.
        object.__setattr__(self, "K", int(self.K))
        object.__setattr__(self, "accepted_count_histogram", tuple(int(c) for c in counts))
        object.__setattr__(self, "stopped_histogram", tuple(int(c) for c in stopped))

    @classmethod
    def from_histogram(cls, histogram: Sequence[int] | np.ndarray) -> AcceptanceStats:
        """Stats from counts of steps with 0..K accepted drafts; K is len(histogram) - 1."""
        counts = tuple(np.asarray(histogram).tolist())
        return cls(K=len(counts) - 1, accepted_count_histogram=counts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AcceptanceStats:
        """Inverse of `to_dict`: only K and the histograms are read, the rest is derived again."""
        return cls(K=data["K"], accepted_count_histogram=tuple(data["accepted_count_histogram"]),
                   stopped_histogram=tuple(data.get("stopped_histogram", ())))

    @property
    def num_steps(self) -> int:
        """Number of decoding steps logged."""
        return sum(self.accepted_count_histogram)

    @property
    def mean_accepted_length(self) -> float:
        """MAL τ = mean over steps of (num_accepted + 1); NaN when no step was logged."""
        if self.num_steps == 0:
            return math.nan
        emitted = sum((n + 1) * count for n, count in enumerate(self.accepted_count_histogram))
        return emitted / self.num_steps

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Conditional acceptance a_k for k = 1..K (length K); NaN where no step reached k-1.

        a_k = #(steps with num_accepted >= k) / #(steps that tried draft k), where a step tries draft
        k when it accepted >= k-1 drafts and did not stop at k-1. A NaN means the position was never
        tried, which is different from an acceptance of 0, so it is not hidden.
        """
        # reached[k] = #steps with num_accepted >= k, for k = 0..K (reached[0] = num_steps).
        reached = np.cumsum(self.accepted_count_histogram[::-1])[::-1].tolist()
        tried = [reached[k - 1] - self.stopped_histogram[k - 1] for k in range(1, self.K + 1)]
        return tuple(
            reached[k] / tried[k - 1] if tried[k - 1] > 0 else math.nan for k in range(1, self.K + 1)
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary; NaN becomes None because JSON has no NaN."""
        return {
            "K": self.K,
            "num_steps": self.num_steps,
            "mean_accepted_length": _nan_to_none(self.mean_accepted_length),
            "acceptance_by_position": [_nan_to_none(a) for a in self.acceptance_by_position],
            "accepted_count_histogram": list(self.accepted_count_histogram),
            **({"stopped_histogram": list(self.stopped_histogram)} if any(self.stopped_histogram) else {}),
        }


def acceptance_stats(num_accepted: Sequence[int] | np.ndarray | torch.Tensor, K: int,
                     num_drafted: Sequence[int] | np.ndarray | None = None) -> AcceptanceStats:
    """Acceptance statistics of a step log.

    Args:
        num_accepted: accepted-draft count of each step, integers in 0..K. Any shape is accepted
            (e.g. (S,) for one sequence or (B, S) for a batch); every entry counts as one step.
            A tensor may live on any device; it is copied to the CPU once.
        K: draft block length of every logged step.
        num_drafted: drafts verified in each step (0..K, same shape as num_accepted); None or empty
            when every step verified K. A step that verified none (the cost-aware length's plain decode
            step) says nothing about acceptance and is left out.

    Returns:
        The histogram of the counts, with τ and per-position conditional acceptance derived from it.
    """
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise ValueError(f"K must be an integer >= 1, got {K!r}")
    if isinstance(num_accepted, torch.Tensor):
        num_accepted = num_accepted.detach().cpu().numpy()
    values = np.asarray(num_accepted).reshape(-1)
    if values.size == 0:
        return AcceptanceStats(K=K, accepted_count_histogram=(0,) * (K + 1))
    if values.dtype.kind not in "iu":
        raise ValueError(f"num_accepted must hold integers, got dtype {values.dtype}")
    bad = np.flatnonzero((values < 0) | (values > K))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"num_accepted must lie in 0..K = 0..{K}; got {values[i].item()} at step {i} "
            f"({bad.size} out-of-range step(s) in total)"
        )
    stopped: tuple[int, ...] = ()
    if num_drafted is not None and len(num_drafted):
        drafted = np.asarray(num_drafted).reshape(-1)
        if drafted.shape != values.shape or np.any((drafted < 0) | (drafted > K) | (values > drafted)):
            raise ValueError(f"num_drafted must give, for each of the {values.size} steps, a count in 0..K = 0..{K} "
                             f"no smaller than its num_accepted; got {drafted.tolist()[:10]}")
        values, drafted = values[drafted > 0], drafted[drafted > 0]  # 0 drafted: a plain decode step
        short = values[(values == drafted) & (drafted < K)]
        stopped = tuple(np.bincount(short, minlength=K + 1).tolist())
    histogram = np.bincount(values, minlength=K + 1)
    return AcceptanceStats(K=K, accepted_count_histogram=tuple(histogram.tolist()), stopped_histogram=stopped)


def merge_stats(stats: Iterable[AcceptanceStats]) -> AcceptanceStats:
    """Combine stats of several sequences or runs with the same K by adding their histograms.

    The result equals `acceptance_stats` of the concatenated step logs, so τ is weighted by steps,
    not an average of per-sequence averages.
    """
    stats = list(stats)
    if not stats:
        raise ValueError("merge_stats needs at least one AcceptanceStats (K cannot be inferred from none)")
    K = stats[0].K
    for i, s in enumerate(stats):
        if s.K != K:
            raise ValueError(
                f"cannot merge stats with different K: stats[0] has K={K}, stats[{i}] has K={s.K}"
            )
    histogram = np.sum([s.accepted_count_histogram for s in stats], axis=0)
    stopped = np.sum([s.stopped_histogram for s in stats], axis=0)
    return AcceptanceStats(K=K, accepted_count_histogram=tuple(histogram.tolist()),
                           stopped_histogram=tuple(stopped.tolist()))


def expected_accepted_length(acceptance_by_position: Sequence[float] | np.ndarray | torch.Tensor) -> float:
    """Expected τ implied by per-position conditional acceptance a_1..a_K.

    Draft k is accepted only if drafts 1..k are, which happens with probability prod_{j<=k} a_j, and
    every step emits one target token besides, so E[τ] = 1 + sum_k prod_{j<=k} a_j. Applied to
    `AcceptanceStats.acceptance_by_position` of steps that all verified K drafts it gives back
    `mean_accepted_length` exactly (steps that stopped early accept fewer than this predicts); in training
    validation it turns the drafter's per-position acceptance into the τ it predicts.

    A NaN a_k is allowed only after the running product has reached 0 (the position was never tried,
    and it cannot contribute); a NaN before that raises, since τ would then be unknown.
    """
    if isinstance(acceptance_by_position, torch.Tensor):
        acceptance_by_position = acceptance_by_position.detach().cpu().double().numpy()
    rates = np.asarray(acceptance_by_position, dtype=np.float64).reshape(-1)
    tau = 1.0
    reach = 1.0  # probability that drafts 1..k are all accepted
    for k, a in enumerate(rates.tolist(), start=1):
        if reach == 0.0:
            break
        if math.isnan(a) or not 0.0 <= a <= 1.0:
            raise ValueError(
                f"acceptance at position {k} must be a probability in [0, 1] while earlier positions "
                f"can still be reached; got {a}"
            )
        reach *= a
        tau += reach
    return tau


def summarize_times(seconds: Sequence[float] | np.ndarray) -> dict[str, float | int]:
    """min / median / max / mean (seconds) and n of repeated timings.

    Timings on shared machines are noisy (docs/design.md#measurement), so the spread is reported with the centre
    rather than a mean alone.
    """
    values = np.asarray(seconds, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("summarize_times needs at least one timing, got none")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"timings must be finite and >= 0 seconds; got {values[i]} at index {i}")
    return {
        "min": float(values.min()),
        "median": float(np.median(values)),
        "max": float(values.max()),
        "mean": float(values.mean()),
        "n": int(values.size),
    }


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x
