"""The engine's thread: owns the model, the pool and the engine; talks to asyncio through queues.

HTTP handlers run on the event loop; decoding runs here, in ONE background thread, so the engine
never needs a lock. Handlers send commands (add / cancel) through a thread-safe `queue.Queue`; the
thread delivers each request's updates to the handler's `asyncio.Queue` with
`loop.call_soon_threadsafe`. Between steps the thread drains every pending command, so a request
joins the very next step; when idle it blocks on the command queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from hspec.serving.engine import Engine, Request, RequestUpdate
from hspec.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: Request
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestUpdate]


@dataclass(frozen=True)
class _Cancel:
    request_id: str


class EngineWorker:
    """Runs `engine` in a daemon thread between `start()` and `stop()`."""

    def __init__(self, engine: Engine, metrics: ServingMetrics | None = None, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[_Add | _Cancel] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestUpdate]]] = {}  # thread-owned
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

    def submit(self, request: Request) -> asyncio.Queue[RequestUpdate]:
        """Queue `request` (validated by the caller with `engine.validate`); returns its update queue.

        Must be called from a running event loop; updates arrive on that loop.
        """
        sink: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self._commands.put(_Add(request, asyncio.get_running_loop(), sink))
        return sink

    def cancel(self, request_id: str) -> None:
        """Stop a request (a client went away); its blocks are freed before the next step."""
        self._commands.put(_Cancel(request_id))

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        last = time.perf_counter()
        with torch.inference_mode():
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    try:
                        report = self.engine.step()
                        updates = report.updates
                        if self.metrics is not None:
                            self.metrics.observe_step(report)
                    except Exception as err:  # never let the thread die: fail what is live, keep serving
                        log.exception("engine step failed")
                        updates = self.engine.abort_all(f"engine error: {type(err).__name__}: {err}")
                    self._deliver(updates)
                now = time.perf_counter()
                if self.metrics is not None:
                    usage = self.engine.pool.utilization()
                    self.metrics.observe_time(now - last, usage)
                    self.metrics.observe_load(usage, self.engine.num_running, self.engine.num_waiting)
                last = now
        self._deliver(self.engine.abort_all("server shutting down"))

    def _drain(self, block: bool) -> None:
        """Apply every pending command; wait briefly for one first when the engine is idle."""
        try:
            command = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                self._add(command)
            else:
                if self.engine.cancel(command.request_id) and self.metrics is not None:
                    self.metrics.requests_finished.labels("cancelled").inc()
                self._sinks.pop(command.request_id, None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: _Add) -> None:
        request_id = command.request.request_id
        self._sinks[request_id] = (command.loop, command.sink)
        try:
            self.engine.add(command.request)
        except Exception as err:  # a request the engine cannot take fails alone; the thread keeps serving
            message = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
            self._deliver([RequestUpdate(request_id, (), 0, "error", message)])
            return
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(command.request.prompt_ids))

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
