"""Continuous batching over the paged KV pool: requests join and leave between decoding steps.

One `Engine.step()`:
1. schedule: ask the pure policy (`scheduler.schedule`) which running sequences to preempt and which
   waiting requests to admit, given the pool's free pages and the positions every running sequence
   writes in a step (`Engine.growth`: K+1, or node budget + 1 for a drafter that proposes trees);
2. preempt: free each victim's pages and drafter state and put it back in the waiting queue, with
   its prompt + outputs so far as the prefix to recompute (same generator, so its output is unchanged)
   and what the drafter carries between steps beyond that prefix (`Drafter.carried_state`);
3. admit: prefill each admitted request (a new one also draws and emits its first token x0; a
   recomputed one gets its carried drafter state back);
4. decode: one batched draft -> verify -> commit step for all running sequences, ragged acceptance;
   or, while more sequences run than `speculate_max_batch`, one plain decoding step for all of them
   (`DecodeStages.step_plain`): on hardware where a batch already fills the compute, verifying K+1
   positions per row costs nearly K+1 times a plain step, so speculation only pays for small batches;
5. emit: append each row's tokens (EOS, max_tokens, stop strings), finish and free finished rows.

The engine is single-threaded and synchronous; `worker.EngineWorker` runs it in one background thread
for the HTTP server. It never raises for a full pool: requests wait, or the youngest is preempted.
A request that could not run even alone in the whole pool is refused when added (`validate`).

Exactness: every random draw comes from the request's own generator, and a recompute restarts at a
step boundary with the same history and drafter state, so a request's tokens are the ones
`SpeculativeDecoder.generate` gives it alone (bit-exact up to float reassociation across batch shapes,
which greedy decoding absorbs unless two logits tie). With `speculate_max_batch` a sampled request's
tokens also depend on which of its steps were plain (a plain step draws its token with one uniform,
a speculative one by rejection sampling), so they are not the ones it gets alone; each step still
samples from the target's distribution, and greedy output is unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hspec.cache.paged_pool import PagedKVPool, pages_for
from hspec.decoding.step import DecodeStages, SequenceOutput
from hspec.sampling import SamplingBatch, SamplingParams
from hspec.serving.scheduler import RunningSeq, WaitingSeq, schedule

log = logging.getLogger(__name__)

# What a client is told when its request failed inside the engine; the exception goes to the server log only.
PREFILL_FAILED = "the engine failed to prefill this request (the server log has the details)"
DECODE_FAILED = "the engine failed while decoding this request (the server log has the details)"


@dataclass(frozen=True)
class Request:
    """One generation request as the engine receives it (already tokenised)."""

    request_id: str  # unique among the engine's live requests
    prompt_ids: tuple[int, ...]
    max_tokens: int  # most new tokens
    sampling: SamplingParams = SamplingParams()
    seed: int = 0  # seeds the request's own generator: output independent of the batch
    stop: tuple[str, ...] = ()  # stop strings; output ends at the token completing one


@dataclass(frozen=True)
class RequestUpdate:
    """New output of one request after a step; the last update of a request has `finish_reason`."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens emitted in this step (may be empty on finish)
    num_output_tokens: int  # output length so far
    finish_reason: str | None = None  # "eos", "length", "stop", "cancelled" or "error"
    error: str | None = None  # message when finish_reason == "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepReport:
    """What one `Engine.step` did, for delivery and metrics."""

    updates: list[RequestUpdate]
    num_decoded: int  # rows of the batched decoding step (0 when nothing ran)
    num_accepted: list[int]  # per row of the speculative step (empty for plain decoding or no step)
    num_drafted: list[int]  # per row: drafts verified (K, fewer where `KIND:P` stopped early; a tree: its depth)
    K: int
    num_prefill_tokens: int  # positions prefilled, recomputes included
    num_new_tokens: int  # tokens emitted to outputs
    num_preempted: int
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float  # pool pages in use / total, after the step
    duration_s: float
    num_failed: int = 0  # requests failed by an error in this step (prefill or decoding)


@dataclass
class _Sequence:
    """Engine-side state of one request."""

    request: Request
    key: int  # the pool / drafter sequence id
    arrival: int  # order of `add`; never changes, so a preempted request keeps its age and place
    generator: torch.Generator
    sampling: SamplingBatch  # one row
    output: SequenceOutput
    history: list[int]  # prompt + outputs; ends with the anchor x0 once the first token exists
    num_preemptions: int = 0
    carried: object | None = None  # the drafter's `carried_state` while preempted, restored after the recompute

    @property
    def prefill_tokens(self) -> list[int]:
        """What a prefill must write: the prompt, or after a preemption the history without x0."""
        return self.history if not self.output.token_ids else self.history[:-1]


class Engine:
    """Continuous batching for one target + drafter over one KV pool."""

    def __init__(self, stages: DecodeStages, pool: PagedKVPool, max_running: int = 256,
                 speculate_max_batch: int | None = None) -> None:
        """`speculate_max_batch`: speculate only while at most this many sequences run (None: always)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if speculate_max_batch is not None and speculate_max_batch < 0:
            raise ValueError(f"speculate_max_batch must be >= 0 (0: never speculate) or None (always), "
                             f"got {speculate_max_batch}")
        if pool.num_drafter_layers < stages.drafter.num_drafter_layers:
            raise ValueError(f"the drafter needs {stages.drafter.num_drafter_layers} pool layers, the pool has "
                             f"{pool.num_drafter_layers}")
        self.stages = stages
        self.pool = pool
        self.max_running = max_running
        self.speculate_max_batch = speculate_max_batch
        self._waiting: dict[str, _Sequence] = {}  # by request id, in arrival order
        self._running: dict[str, _Sequence] = {}
        self._next_key = 0
        self.num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------------

    @property
    def K(self) -> int:
        return self.stages.K

    @property
    def growth(self) -> int:
        """Positions a running sequence writes in one step, what the scheduler reserves for it
        (`DecodeStages.growth`)."""
        return self.stages.growth

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def validate(self, request: Request) -> None:
        """Raise ValueError, naming the limit, if `request` could never run. Reads only constants."""
        self.stages.check_request(request.prompt_ids, request.max_tokens, request.stop)
        needed = self.stages.positions_needed(len(request.prompt_ids), request.max_tokens)
        if pages_for(needed, self.pool.page_size) > self.pool.num_pages:
            raise ValueError(
                f"prompt has {len(request.prompt_ids)} tokens; with max_tokens={request.max_tokens} and "
                f"K={self.K} it needs {needed} KV positions, more than the pool's capacity of "
                f"{self.pool.capacity_tokens} tokens"
            )

    def room_for_output(self, prompt_length: int) -> int:
        """The largest max_tokens a prompt of `prompt_length` tokens passes `validate` with (< 1: none).

        The tighter of the target's context and the whole pool, less the prompt and one draft block.
        """
        limit = min(self.stages.target.config.max_position_embeddings, self.pool.capacity_tokens)
        return limit - self.stages.positions_needed(prompt_length, 0)

    def add(self, request: Request) -> None:
        """Queue a request (raises ValueError if it is invalid or its id is live)."""
        if request.request_id in self._waiting or request.request_id in self._running:
            raise ValueError(f"request id {request.request_id!r} is already live")
        self.validate(request)
        device = self.stages.device
        key = self._next_key
        self._next_key += 1
        self._waiting[request.request_id] = _Sequence(
            request, key, key, torch.Generator(device=device).manual_seed(request.seed),
            SamplingBatch.from_params([request.sampling], device), SequenceOutput(list(request.prompt_ids)),
            list(request.prompt_ids))

    def cancel(self, request_id: str) -> bool:
        """Drop a live request and free what it holds; True if it was live. No update is sent for it."""
        seq = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
        if seq is None:
            return False
        self.stages.release(self.pool, seq.key)
        return True

    def abort_all(self, message: str) -> list[RequestUpdate]:
        """Fail every live request (after an unexpected error) and free the pool."""
        updates = []
        for request_id in list(self._running) + list(self._waiting):
            seq = self._running.get(request_id) or self._waiting[request_id]
            self.cancel(request_id)
            updates.append(RequestUpdate(request_id, (), len(seq.output.token_ids), "error", message))
        return updates

    def output(self, request_id: str) -> SequenceOutput:
        """The output so far of a live request (for tests and inspection)."""
        seq = self._running.get(request_id) or self._waiting[request_id]
        return seq.output

    # ---- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepReport:
        """Run stages 1-5 once; returns every request's new tokens and the step's statistics."""
        start = time.perf_counter()
        updates: list[RequestUpdate] = []
        new_tokens: dict[str, list[int]] = {}

        # 1. schedule.
        bs = self.pool.page_size
        lengths = self.pool.lengths([s.key for s in self._running.values()])
        # The pool holds exactly ceil(length / page_size) pages per sequence (truncate frees the rest).
        running = [RunningSeq(s.key, s.arrival, n, pages_for(n, bs)) for s, n in zip(self._running.values(), lengths)]
        waiting = [WaitingSeq(s.key, s.arrival, len(s.prefill_tokens)) for s in self._waiting.values()]
        plan = schedule(running, waiting, self.pool.num_free_pages, self.pool.page_size, self.growth,
                        self.max_running)
        by_key = {s.key: s for s in [*self._running.values(), *self._waiting.values()]}

        # 2. preempt with recompute: free everything now, rebuild from the history on readmission; keep
        #    only what the drafter carries between steps and a prefill cannot rebuild.
        for key in plan.preempt:
            seq = by_key[key]
            seq.carried = self.stages.drafter.carried_state(seq.key)
            self.stages.release(self.pool, seq.key)
            del self._running[seq.request.request_id]
            seq.num_preemptions += 1
            self._waiting[seq.request.request_id] = seq
        self._waiting = dict(sorted(self._waiting.items(), key=lambda item: item[1].arrival))
        self.num_preemptions += len(plan.preempt)

        # 3. admit and prefill; a new request draws its first token x0 here.
        num_prefill = 0
        for key in plan.admit:
            seq = by_key[key]
            request_id = seq.request.request_id
            del self._waiting[request_id]
            tokens = seq.prefill_tokens
            try:
                logits = self.stages.prefill(self.pool, seq.key, tokens, len(seq.request.prompt_ids))
                self.stages.drafter.restore_carried_state(seq.key, seq.carried)
                seq.carried = None
                num_prefill += len(tokens)
                if not seq.output.token_ids:
                    token = self.stages.first_token(logits, seq.sampling, seq.generator)
                    seq.history.append(token)
                    self._emit(seq, [token], new_tokens)
            except Exception:  # a bad request must not take the engine down
                log.exception("prefill of %s failed", request_id)
                updates.append(self._fail(seq, PREFILL_FAILED))
                continue
            if seq.output.finish_reason is None:
                self._running[request_id] = seq
            else:
                self.stages.release(self.pool, seq.key)
                updates.append(self._finished_update(seq, new_tokens))

        # 4. one batched speculative step for every running sequence (a plain one above speculate_max_batch).
        num_accepted: list[int] = []
        num_drafted: list[int] = []
        num_decoded = len(self._running)
        if self._running:
            num_accepted, num_drafted = self._decode(updates, new_tokens)
        for request_id, tokens in new_tokens.items():
            if request_id in self._running and tokens:
                seq = self._running[request_id]
                updates.append(RequestUpdate(request_id, tuple(tokens), len(seq.output.token_ids)))
        return StepReport(updates, num_decoded, num_accepted, num_drafted, self.K, num_prefill,
                          sum(len(u.new_token_ids) for u in updates), len(plan.preempt), len(self._running),
                          len(self._waiting), self.pool.utilization(), time.perf_counter() - start,
                          sum(u.finish_reason == "error" for u in updates))

    # ---- helpers ------------------------------------------------------------------------------

    def _decode(self, updates: list[RequestUpdate], new_tokens: dict[str, list[int]]) -> tuple[list[int], list[int]]:
        """Stages 4-5 for every running sequence; returns the accepted and drafted counts (empty when
        the step did not speculate)."""
        batch = list(self._running.values())
        limit = self.speculate_max_batch
        speculate = self.K > 0 and (limit is None or len(batch) <= limit)
        step = self.stages.step if speculate or self.K == 0 else self.stages.step_plain
        try:
            result = step(self.pool, [s.key for s in batch], [s.history for s in batch],
                          _stack_sampling([s.sampling for s in batch]), [s.generator for s in batch])
        except Exception:  # fail this batch's requests, keep serving the rest
            log.exception("decoding step of %d sequences failed", len(batch))
            for seq in batch:
                del self._running[seq.request.request_id]
                updates.append(self._fail(seq, DECODE_FAILED))
            return [], []
        # 5. emit, finish and free.
        for row, seq in enumerate(batch):
            if speculate:
                seq.output.num_accepted.append(result.num_accepted[row])
                seq.output.num_drafted.append(result.num_drafted[row])
            seq.history.extend(result.new_tokens[row])
            self._emit(seq, result.new_tokens[row], new_tokens)
            if seq.output.finish_reason is not None:
                del self._running[seq.request.request_id]
                self.stages.release(self.pool, seq.key)
                updates.append(self._finished_update(seq, new_tokens))
        return (list(result.num_accepted), list(result.num_drafted)) if speculate else ([], [])

    def _emit(self, seq: _Sequence, tokens: Sequence[int], new_tokens: dict[str, list[int]]) -> None:
        r = seq.request
        emitted = self.stages.emit(seq.output, tokens, r.max_tokens, r.stop)
        new_tokens.setdefault(r.request_id, []).extend(emitted)

    def _finished_update(self, seq: _Sequence, new_tokens: dict[str, list[int]]) -> RequestUpdate:
        tokens = tuple(new_tokens.pop(seq.request.request_id, ()))
        return RequestUpdate(seq.request.request_id, tokens, len(seq.output.token_ids), seq.output.finish_reason)

    def _fail(self, seq: _Sequence, message: str) -> RequestUpdate:
        self.stages.release(self.pool, seq.key)
        return RequestUpdate(seq.request.request_id, (), len(seq.output.token_ids), "error", message)


def _stack_sampling(rows: Sequence[SamplingBatch]) -> SamplingBatch:
    """Concatenate one-row sampling batches into one (B rows)."""
    return SamplingBatch(torch.cat([r.temperature for r in rows]), torch.cat([r.top_p for r in rows]),
                         torch.cat([r.top_k for r in rows]))
