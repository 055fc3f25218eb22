"""The engine's thread: owns the model, the pool and the engine; talks to asyncio through queues.

HTTP handlers run on the event loop; decoding runs here, in ONE background thread, so the engine
never needs a lock. Handlers send commands (add / cancel / abort) through a thread-safe
`queue.Queue`; the thread delivers each request's updates to the handler's `asyncio.Queue` with
`loop.call_soon_threadsafe`. Between steps the thread drains every pending command, so a request
joins the very next step; when idle it blocks on the command queue.

Failure is loud. A step that raises fails the requests it held; `max_failed_steps` failed steps in
a row (a broken device context fails every one) mark the engine broken, as does the thread dying
(an error inside the error handling). Then every live and queued request gets an error update, new
ones are refused (`EngineUnavailable`, a 503), and `failure` says why, for /health and for the
server, which exits non-zero so a supervisor restarts it. No request is ever left without an answer:
a command is queued only while the thread will still read it (`_lock`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from hspec.serving.engine import DECODE_FAILED, Engine, Request, RequestUpdate
from hspec.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

class EngineUnavailable(Exception):
    """The engine takes no new requests: it failed, or the server is shutting down."""


@dataclass(frozen=True)
class _Add:
    request: Request
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestUpdate]


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Abort:
    message: str  # every live request fails with it (the shutdown drain ran out)


class EngineWorker:
    """Runs `engine` in a daemon thread between `start()` and `stop()`."""

    def __init__(self, engine: Engine, metrics: ServingMetrics | None = None, idle_wait_s: float = 0.05,
                 max_failed_steps: int = 3) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.max_failed_steps = max_failed_steps
        self.failure: str | None = None  # why the engine is broken; set once, by the thread
        self._commands: queue.Queue[_Add | _Cancel | _Abort] = queue.Queue()
        self._lock = threading.Lock()  # `_closed` and queuing an add change together
        self._closed: str | None = None  # why adds are refused; once set the thread reads no more adds
        self._queued_adds = 0  # adds queued and not yet taken by the thread (under `_lock`)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestUpdate]]] = {}  # thread-owned
        self._failed_steps = 0  # failed steps in a row (thread-owned)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- called from the event loop -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine worker is already started")
        self._thread = threading.Thread(target=self._run, name="hspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Running and not broken (what /health reports)."""
        return self.alive and self.failure is None

    @property
    def refusal(self) -> str | None:
        """Why a new request would be refused now, or None."""
        if self.failure is not None:
            return self.failure
        if self._closed is not None:
            return self._closed
        return None if self.alive else "the engine is not running"

    @property
    def num_waiting(self) -> int:
        """Requests queued for the engine and not yet running (a lock-free estimate, for backpressure)."""
        return self.engine.num_waiting + self._queued_adds

    def submit(self, request: Request) -> asyncio.Queue[RequestUpdate]:
        """Queue `request` (validated by the caller with `engine.validate`); returns its update queue.

        Must be called from a running event loop; updates arrive on that loop. Raises EngineUnavailable
        when the engine takes no new requests.
        """
        sink: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        with self._lock:
            reason = self.refusal
            if reason is not None:
                raise EngineUnavailable(reason)
            self._queued_adds += 1
            self._commands.put(_Add(request, asyncio.get_running_loop(), sink))
        return sink

    def cancel(self, request_id: str) -> None:
        """Stop a request (a client went away); its pages are freed before the next step."""
        self._commands.put(_Cancel(request_id))

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (shutdown begins); live ones go on."""
        with self._lock:
            self._closed = self._closed or reason

    def abort_live(self, message: str) -> None:
        """Fail every live request with `message` before the next step (the shutdown drain ran out)."""
        self._commands.put(_Abort(message))

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self._serve()
            self._deliver(self.engine.abort_all(self._closed or "the server is shutting down"))
        except BaseException as err:  # an error while handling an error: the engine state is unknown
            log.exception("the engine thread died")
            self.failure = self.failure or f"the engine thread died ({type(err).__name__}); the server must restart"
        finally:
            with self._lock:
                self._closed = self._closed or self.failure or "the server is shutting down"
            self._fail_the_rest(self.failure or self._closed or "")

    def _serve(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set() and self.failure is None:
            self._drain(block=not self.engine.has_work)
            if self.engine.has_work:
                self._step()
            now = time.perf_counter()
            if self.metrics is not None:
                usage = self.engine.pool.utilization()
                self.metrics.observe_time(now - last, usage)
                self.metrics.observe_load(usage, self.engine.num_running, self.engine.num_waiting)
            last = now

    def _step(self) -> None:
        """One engine step; a failure fails what the step held and counts towards `max_failed_steps`."""
        try:
            report = self.engine.step()
        except Exception:  # fail what is live and keep serving; an error in abort_all kills the thread
            log.exception("engine step failed")
            failed, updates = True, self.engine.abort_all(DECODE_FAILED)
        else:
            # A step that lost requests to an error and moved none forward is a failed step: an engine
            # whose every batch fails (a broken device) must not look healthy.
            failed, updates = report.num_failed > 0 and report.num_new_tokens == 0, report.updates
            if self.metrics is not None:
                self.metrics.observe_step(report)
        self._failed_steps = self._failed_steps + 1 if failed else 0
        if self._failed_steps >= self.max_failed_steps:  # set before delivering: their handlers answer 503
            log.error("%d engine steps failed in a row: the engine is broken", self._failed_steps)
            self.failure = (f"the engine failed {self._failed_steps} steps in a row and takes no more requests; "
                            "the server must restart")
            updates += self.engine.abort_all(self.failure)
        self._deliver(updates)

    def _drain(self, block: bool) -> None:
        """Apply every pending command; wait briefly for one first when the engine is idle."""
        try:
            command = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                with self._lock:
                    self._queued_adds -= 1
                self._add(command)
            elif isinstance(command, _Cancel):
                if self.engine.cancel(command.request_id) and self.metrics is not None:
                    self.metrics.requests_finished.labels("cancelled").inc()
                self._sinks.pop(command.request_id, None)
            else:
                self._deliver(self.engine.abort_all(command.message))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: _Add) -> None:
        request_id = command.request.request_id
        self._sinks[request_id] = (command.loop, command.sink)
        try:
            self.engine.add(command.request)
        except ValueError as err:  # a request the engine cannot take fails alone; the thread keeps serving
            self._deliver([RequestUpdate(request_id, (), 0, "error", str(err))])
            return
        except Exception:
            log.exception("engine.add failed")
            self._deliver([RequestUpdate(request_id, (), 0, "error", DECODE_FAILED)])
            return
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(command.request.prompt_ids))

    def _fail_the_rest(self, message: str) -> None:
        """Fail every request the thread still knows or has queued, without touching the engine."""
        updates = [RequestUpdate(request_id, (), 0, "error", message) for request_id in self._sinks]
        self._deliver(updates)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._sinks[command.request.request_id] = (command.loop, command.sink)
                self._deliver([RequestUpdate(command.request.request_id, (), 0, "error", message)])

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            target = self._sinks.pop(update.request_id, None) if update.finished else \
                self._sinks.get(update.request_id)
            if target is None:  # cancelled meanwhile
                continue
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, update)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
