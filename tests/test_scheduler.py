"""The pure admission / preemption policy of the serving engine."""

from __future__ import annotations

import pytest

from hspec.cache.paged_pool import pages_for
from hspec.serving.scheduler import RunningSeq, WaitingSeq, schedule


def _running(key, arrival, length, page_size=4):
    return RunningSeq(key, arrival, length, pages_for(length, page_size))


def test_admits_in_arrival_order_while_prefill_and_growth_fit():
    waiting = [WaitingSeq(2, 2, 6), WaitingSeq(1, 1, 6), WaitingSeq(3, 3, 6)]
    # each needs pages_for(6 + 3, 4) = 3 pages; 7 free pages hold two of them
    plan = schedule([], waiting, free_pages=7, page_size=4, growth=3, max_running=8)
    assert plan.admit == (1, 2) and plan.preempt == ()


def test_first_come_first_served_stops_at_the_first_that_does_not_fit():
    waiting = [WaitingSeq(1, 1, 40), WaitingSeq(2, 2, 1)]
    plan = schedule([], waiting, free_pages=5, page_size=4, growth=2, max_running=8)
    assert plan.admit == ()  # the small one does not jump the queue


def test_running_growth_is_reserved_before_admission():
    running = [_running(0, 0, 8)]  # holds 2 pages, needs a 3rd to grow by 3
    plan = schedule(running, [WaitingSeq(1, 1, 4)], free_pages=2, page_size=4, growth=3, max_running=8)
    assert plan.admit == ()  # 1 page left after the reservation, the request needs 2
    plan = schedule(running, [WaitingSeq(1, 1, 4)], free_pages=3, page_size=4, growth=3, max_running=8)
    assert plan.admit == (1,)


def test_max_running_caps_the_batch():
    waiting = [WaitingSeq(k, k, 1) for k in range(5)]
    plan = schedule([_running(9, -1, 1)], waiting, free_pages=100, page_size=4, growth=1, max_running=3)
    assert plan.admit == (0, 1)


def test_preempts_the_youngest_until_the_rest_can_grow():
    running = [_running(0, 0, 8), _running(1, 1, 8), _running(2, 2, 8)]  # each needs 1 more page
    plan = schedule(running, [WaitingSeq(5, 5, 1)], free_pages=1, page_size=4, growth=1, max_running=8)
    # dropping 2 frees its 2 pages: 3 free for the 2 pages 0 and 1 need
    assert plan.preempt == (2,) and plan.admit == ()
    plan = schedule(running, [], free_pages=0, page_size=4, growth=1, max_running=8)
    assert plan.preempt == (2,)


def test_no_preemption_when_growth_stays_inside_held_pages():
    running = [_running(0, 0, 5), _running(1, 1, 6)]  # 2 pages each, room for 2 more positions
    plan = schedule(running, [], free_pages=0, page_size=4, growth=2, max_running=8)
    assert plan.preempt == () and plan.admit == ()


def test_bad_arguments():
    with pytest.raises(ValueError, match="growth"):
        schedule([], [], free_pages=1, page_size=4, growth=0, max_running=1)
