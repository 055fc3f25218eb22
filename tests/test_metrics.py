"""Acceptance statistics on small step logs worked out by hand."""

import json
import math

import numpy as np
import pytest
import torch

from hspec.metrics import (
    AcceptanceStats,
    acceptance_stats,
    expected_accepted_length,
    merge_stats,
    summarize_times,
)

# K = 3, six steps. Steps reaching position k-1 / accepting draft k:
#   k=1: 6 tried, 4 accepted (the counts >= 1: 1, 3, 2, 1)
#   k=2: 4 tried, 2 accepted (3, 2)
#   k=3: 2 tried, 1 accepted (3)
LOG = [0, 1, 3, 2, 0, 1]


def test_hand_computed_log():
    stats = acceptance_stats(LOG, K=3)
    assert stats.num_steps == 6
    assert stats.accepted_count_histogram == (2, 2, 1, 1)
    # τ = mean(n + 1) = (1 + 2 + 4 + 3 + 1 + 2) / 6 = 13 / 6
    assert stats.mean_accepted_length == pytest.approx(13 / 6)
    assert stats.acceptance_by_position == pytest.approx((4 / 6, 2 / 4, 1 / 2))


def test_input_types_agree():
    expected = acceptance_stats(LOG, K=3)
    assert acceptance_stats(np.array(LOG, dtype=np.int32), K=3) == expected
    assert acceptance_stats(torch.tensor(LOG), K=3) == expected
    # A (B, S) batch log counts every entry as a step.
    assert acceptance_stats(torch.tensor(LOG).reshape(2, 3), K=3) == expected


def test_bounds_of_tau():
    assert acceptance_stats([0, 0, 0], K=4).mean_accepted_length == 1.0
    assert acceptance_stats([4, 4], K=4).mean_accepted_length == 5.0


def test_untried_positions_are_nan():
    stats = acceptance_stats([1, 0, 1], K=4)
    a = stats.acceptance_by_position
    assert a[0] == pytest.approx(2 / 3)
    assert a[1] == 0.0  # tried twice, never accepted: a real 0, not NaN
    assert math.isnan(a[2]) and math.isnan(a[3])  # never reached


def test_empty_log():
    stats = acceptance_stats([], K=2)
    assert stats.num_steps == 0
    assert math.isnan(stats.mean_accepted_length)
    assert all(math.isnan(a) for a in stats.acceptance_by_position)
    assert stats.to_dict()["mean_accepted_length"] is None


def test_to_dict_is_json_ready_and_round_trips():
    stats = acceptance_stats([1, 0, 1], K=4)
    d = stats.to_dict()
    text = json.dumps(d, allow_nan=False)  # would raise on a NaN
    assert d["acceptance_by_position"][2:] == [None, None]
    assert d["num_steps"] == 3
    assert AcceptanceStats.from_dict(json.loads(text)) == stats


def test_merge_equals_concatenation():
    logs = [[0, 1, 3], [2, 2], [], [3, 3, 0, 1]]
    merged = merge_stats(acceptance_stats(log, K=3) for log in logs)
    assert merged == acceptance_stats(sum(logs, []), K=3)
    # Steps weigh equally: τ is not the mean of the per-log τ's.
    assert merged.mean_accepted_length == pytest.approx(np.mean(np.array(sum(logs, [])) + 1))


def test_from_histogram():
    stats = AcceptanceStats.from_histogram(np.array([2, 2, 1, 1]))
    assert stats == acceptance_stats(LOG, K=3)
    assert stats.K == 3
    assert type(stats.accepted_count_histogram[0]) is int


@pytest.mark.parametrize(
    "log, K, match",
    [
        ([0, 4, 1], 3, "got 4 at step 1"),
        ([0, -1], 3, "got -1 at step 1"),
        ([0.0, 1.0], 3, "integers"),
        ([1], 0, "K must be"),
    ],
)
def test_acceptance_stats_rejects_bad_input(log, K, match):
    with pytest.raises(ValueError, match=match):
        acceptance_stats(log, K=K)


def test_stats_validation():
    with pytest.raises(ValueError, match="K\\+1 = 4"):
        AcceptanceStats(K=3, accepted_count_histogram=(1, 2))
    with pytest.raises(ValueError, match=r"accepted_count_histogram\[1\]"):
        AcceptanceStats(K=1, accepted_count_histogram=(1, -2))
    with pytest.raises(ValueError, match="different K"):
        merge_stats([acceptance_stats([1], K=2), acceptance_stats([1], K=3)])
    with pytest.raises(ValueError, match="at least one"):
        merge_stats([])


def test_expected_accepted_length():
    assert expected_accepted_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_accepted_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_accepted_length(torch.tensor([0.0, 0.3])) == 1.0
    # From empirical conditional acceptance it gives back τ exactly, NaN tail included.
    for log, K in [(LOG, 3), ([1, 0, 1], 4), ([3, 3, 3], 3)]:
        stats = acceptance_stats(log, K=K)
        assert expected_accepted_length(stats.acceptance_by_position) == pytest.approx(
            stats.mean_accepted_length
        )


def test_expected_accepted_length_rejects_bad_rates():
    with pytest.raises(ValueError, match="position 2"):
        expected_accepted_length([0.5, math.nan])
    with pytest.raises(ValueError, match="1.5"):
        expected_accepted_length([1.5])


def test_summarize_times():
    summary = summarize_times([0.3, 0.1, 0.2, 0.6])
    assert summary == {
        "min": 0.1,
        "median": pytest.approx(0.25),
        "max": 0.6,
        "mean": pytest.approx(0.3),
        "n": 4,
    }
    with pytest.raises(ValueError, match="at least one"):
        summarize_times([])
    with pytest.raises(ValueError, match="-1.0 at index 1"):
        summarize_times([0.1, -1.0])


def test_steps_that_stopped_early_do_not_count_against_the_next_position():
    # K=4; steps: 2 of 4 drafted accepted; 2 of 2 (stopped early); 4 of 4; 0 of 1.
    stats = acceptance_stats([2, 2, 4, 0], 4, num_drafted=[4, 2, 4, 1])
    assert stats.stopped_histogram == (0, 0, 1, 0, 0)
    assert stats.mean_accepted_length == pytest.approx((3 + 3 + 5 + 1) / 4)
    # position 3 is tried by the steps that accepted 2 and went on (the first) and the 4-of-4 step
    assert stats.acceptance_by_position == pytest.approx((3 / 4, 3 / 3, 1 / 2, 1 / 1))
    again = AcceptanceStats.from_dict(stats.to_dict())
    assert again == stats
    merged = merge_stats([stats, acceptance_stats([1], 4)])
    assert merged.stopped_histogram == (0, 0, 1, 0, 0) and merged.num_steps == 5


def test_steps_that_drafted_nothing_are_plain_decodes_left_out():
    """The cost-aware length's 0-draft steps carry no acceptance information."""
    mixed = acceptance_stats([1, 0, 3, 0], 4, num_drafted=[4, 0, 4, 0])
    assert mixed == acceptance_stats([1, 3], 4, num_drafted=[4, 4]) and mixed.num_steps == 2


def test_no_early_stop_keeps_the_old_statistics_and_json():
    plain = acceptance_stats([1, 3, 4], 4)
    full = acceptance_stats([1, 3, 4], 4, num_drafted=[4, 4, 4])
    assert plain == full and "stopped_histogram" not in full.to_dict()


@pytest.mark.parametrize("accepted,drafted", [([2], [1]), ([1], [5]), ([1, 2], [3]), ([0], [-1]), ([1], [0])])
def test_bad_num_drafted_names_the_problem(accepted, drafted):
    with pytest.raises(ValueError, match="num_drafted"):
        acceptance_stats(accepted, 4, num_drafted=drafted)
