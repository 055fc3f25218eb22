"""The cost-aware draft length (`hspec:auto`) for H-Spec inside vLLM.

hspec's engine chooses each row's draft length by its expected tokens per unit of step cost
(`drafters/cost_aware.py`), with costs it measures by timing its own target (`decoding/step_cost.py`).
Inside vLLM the proposer cannot run the target on its own, so it times the engine's steps as they come:
between the end of one `propose_with_target` call and the start of the next, vLLM runs one step, which
verifies the drafts the first call returned (and schedules and samples), so

    seconds(step after n drafts) / seconds(step after 0 drafts) - 1 = first_token + n per_token

and the proposer's own seconds over the 0-draft step's are the draft. While calibrating, a lone request (a
batch of one, the only steps whose time is one request's) gets 0, 1 and K drafts in turn, a fixed cycle
that reads no timing, `CALIBRATION_SAMPLES` steps of each; then the fitted `StepCost` is cached per
machine, vLLM version, target, dtype, checkpoint and K (`cache_root()/vllm_step_costs/`), so later engines
on the machine read it back and never calibrate. Steps that are not a lone request's decode (a prefill,
a batch) are not timed. The growth of a verify with the context (`per_token_key`) is not separated here
(steps are timed at whatever context the requests have); it is 0, the contexts' average in `per_token`.

After calibration every request runs `cost_aware`'s rule on its own record: `best_draft_length` over the
drafter's calibrated confidences, the back-off after steps that did not pay. Greedy drafts are verified by
vLLM's rejection sampler without draft probabilities, and how many a request gets depends only on its own
earlier steps and this step's confidences, never on this step's verdict: outputs stay vLLM's.

Legend: K drafts per step, n drafts a request gets this step.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hspec.drafters.cost_aware import Backoff, RowState
from hspec.drafters.step_cost import StepCost

CALIBRATION_SAMPLES = 8  # timed steps of each draft length (0, 1, K) before the costs are fitted


@dataclass
class StepTimer:
    """Times of a lone request's steps by the drafts they verified, and of the proposer's drafting."""

    K: int
    steps: dict[int, list[float]] = field(default_factory=dict)  # n drafts verified -> seconds per step
    drafting: list[float] = field(default_factory=list)  # seconds of the proposer's drafting

    def calibration_length(self, calls: int) -> int:
        """The draft length of a lone request's step while calibrating: 0, 1, K in turn."""
        return (0, 1, self.K)[calls % 3]

    def complete(self) -> bool:
        return (len(self.drafting) >= CALIBRATION_SAMPLES
                and all(len(self.steps.get(n, ())) >= CALIBRATION_SAMPLES for n in {0, 1, self.K}))

    def fit(self) -> StepCost:
        """StepCost from the medians (module docstring); draft, first_token, per_token in 0-draft steps."""
        decode = statistics.median(self.steps[0])
        one = statistics.median(self.steps[1]) / decode - 1.0
        if self.K > 1:
            per_token = max((statistics.median(self.steps[self.K]) / decode - 1.0 - one) / (self.K - 1), 0.0)
        else:
            per_token = max(one, 0.0)
        first_token = max(one - per_token, 0.0)
        return StepCost(draft=statistics.median(self.drafting) / decode, per_token=per_token, per_token_key=0.0,
                        first_token=first_token)


class AdaptiveLength:
    """Each request's draft length in a vLLM engine (module docstring): calibrating, then cost-aware.

    `cost` given (or cached at `cache_path`): no calibration. Requests are known by vLLM's request ids."""

    def __init__(self, K: int, cache_path: Path | None, cost: StepCost | None = None) -> None:
        self.K = K
        self.cache_path = cache_path
        self.cost = cost if cost is not None else read_cost(cache_path)
        self.timer = StepTimer(K)
        self.rows: dict[str, RowState] = {}
        self._calls = 0
        self._last: tuple[int, float] | None = None  # (drafts given to a lone request, when the call ended)

    def start_step(self, req_ids: Sequence[str], rows_per_request: Sequence[int], verified: Sequence[int],
                   accepted: Sequence[int | None]) -> None:
        """At the start of a proposer call: time the step that just ran, and give each request its verdict.

        req_ids: the step's requests in batch order; rows_per_request: the query rows each ran; verified:
        drafts each had verified (0 where none); accepted: drafts each kept (None: it sampled nothing)."""
        now = time.perf_counter()
        if self.cost is None and self._last is not None and len(req_ids) == 1:
            given, ended = self._last
            if verified[0] == given and rows_per_request[0] == given + 1:  # a decode of exactly those drafts
                self.timer.steps.setdefault(given, []).append(now - ended)
        self._last = None
        for req_id, n, kept in zip(req_ids, verified, accepted):
            state = self.rows.get(req_id)
            if state is None:
                continue
            if state.pending is not None and (kept is None or state.pending[0] != n):
                state.pending = None  # drafts vLLM did not verify as given (e.g. a preemption): no verdict
            if kept is not None:
                state.record(kept)
        for gone in set(self.rows) - set(req_ids):  # finished or aborted requests
            del self.rows[gone]

    def wants_drafts(self, req_id: str, lone: bool) -> bool:
        """Whether the request is drafted for this step (the drafter then proposes K for it)."""
        if self.cost is None:
            return not lone or self.timer.calibration_length(self._calls) > 0
        return self.rows.setdefault(req_id, RowState()).takes_turn()

    def length(self, req_id: str, confidence: Sequence[float], keys: int, lone: bool) -> int:
        """How many of the request's K drafts to give vLLM, from the drafter's confidences c_1..c_K."""
        if self.cost is None:
            return self.timer.calibration_length(self._calls) if lone else self.K
        return self.rows.setdefault(req_id, RowState()).choose(confidence, keys, self.cost, Backoff())

    def end_step(self, lone_drafts: int | None, drafting_s: float | None) -> None:
        """At the end of a proposer call: what a lone request was given (None: not a lone request) and how
        long drafting took (None: the drafter did not run); fit and cache the costs once calibration is done."""
        if self.cost is None:
            if drafting_s is not None and lone_drafts is not None:
                self.timer.drafting.append(drafting_s)
            self._calls += lone_drafts is not None
            if self.timer.complete():
                self.cost = self.timer.fit()
                write_cost(self.cache_path, self.cost)
        self._last = None if lone_drafts is None else (lone_drafts, time.perf_counter())


def read_cost(path: Path | None) -> StepCost | None:
    """The StepCost cached at `path`, None when there is none (or it is unreadable)."""
    if path is None or not path.exists():
        return None
    try:
        return StepCost(**json.loads(path.read_text())["cost"])
    except (ValueError, KeyError, TypeError):
        return None


def write_cost(path: Path | None, cost: StepCost) -> None:
    """Cache `cost` at `path` (a temporary file renamed, so a reader never sees half a file)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"cost": cost.to_dict(), "calibrated_from": "vLLM engine steps"}, indent=1))
    os.replace(tmp, path)
