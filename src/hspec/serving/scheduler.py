"""Admission and preemption policy over the KV pool's free pages (pure: no model, no pool).

Before every engine step each running sequence must be able to grow by the positions one step writes
(`growth`: the verify block [x0, d_1..d_K], K+1; for a drafter that proposes trees [x0 ; the tree's
nodes], node budget + 1, which the rollback after verification then shrinks to the accepted path);
the pool's `extend` is all-or-nothing, so the engine asks this policy first:

1. Preempt: while the running sequences' growth does not fit in the free pages, preempt the
   youngest (latest arrival). Its pages return to the pool and it goes back to the waiting queue,
   to be recomputed from its prompt + outputs so far when it is readmitted.
2. Admit: in arrival order, admit a waiting request when its prefill plus its first step's growth
   fits in what is left after reserving the running sequences' growth. Stop at the first that
   does not fit (first come, first served: a long request is not starved by short ones), and admit
   nothing in a step that had to preempt (the pool is already short).

Progress: the engine refuses a request that could not run alone in the whole pool, so the oldest
request always fits once everything younger is preempted; it is never preempted itself, finishes,
and frees its pages. Hence no livelock and no request waits forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hspec.cache.paged_pool import pages_for


@dataclass(frozen=True)
class RunningSeq:
    """A sequence in the pool, as the policy sees it."""

    key: int  # engine-wide request key
    arrival: int  # arrival order (smaller = older); the youngest is preempted first
    length: int  # positions it holds in the pool now
    held_pages: int  # pages its page table holds now


@dataclass(frozen=True)
class WaitingSeq:
    """A request waiting for admission (new, or preempted and to be recomputed)."""

    key: int
    arrival: int
    prefill_length: int  # positions its prefill will write (prompt, or prompt + outputs - 1)


@dataclass(frozen=True)
class Schedule:
    """What to do before the next step: preempt these running keys, then admit these waiting keys."""

    preempt: tuple[int, ...]
    admit: tuple[int, ...]


def schedule(running: Sequence[RunningSeq], waiting: Sequence[WaitingSeq], free_pages: int,
             page_size: int, growth: int, max_running: int) -> Schedule:
    """Decide preemptions and admissions for one step.

    growth: positions each running sequence writes in a step (K+1, or node budget + 1 for a tree drafter).
    max_running: the most sequences in one batch.
    """
    if growth < 1 or page_size < 1 or max_running < 1:
        raise ValueError(f"need growth, page_size, max_running >= 1; got {growth}, {page_size}, {max_running}")
    by_age = sorted(running, key=lambda s: s.arrival)  # oldest first

    def extra(seq: RunningSeq) -> int:
        return max(0, pages_for(seq.length + growth, page_size) - seq.held_pages)

    # 1. Preempt the youngest until the rest can grow.
    kept = list(by_age)
    free = free_pages
    preempt: list[int] = []
    while kept and sum(extra(s) for s in kept) > free:
        victim = kept.pop()
        preempt.append(victim.key)
        free += victim.held_pages
    if preempt:
        return Schedule(tuple(preempt), ())

    # 2. Admit in arrival order while the prefill and its first step fit.
    available = free - sum(extra(s) for s in kept)
    admit: list[int] = []
    for request in sorted(waiting, key=lambda w: w.arrival):
        if len(kept) + len(admit) >= max_running:
            break
        need = pages_for(request.prefill_length + growth, page_size)
        if need > available:
            break
        admit.append(request.key)
        available -= need
    return Schedule((), tuple(admit))
