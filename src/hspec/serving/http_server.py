"""The HTTP server around the app: uvicorn with a connection bound, a request-head deadline, a
configurable drain on shutdown, and an exit when the engine fails.

Imports uvicorn at import time; server.py imports this module only when it serves, so `hspec serve`
can still tell a user without the `[serve]` extra what to install.

- Connections: at most `max_connections` open; one more is answered 503 and closed at once, so slow
  or idle clients cannot use up the process's file descriptors. uvicorn's `limit_concurrency` (503
  for requests over the bound) and keep-alive timeout apply too.
- Request heads: uvicorn's h11 protocol arms no timer until a first response is sent, so a client
  that connects and sends a head one byte a minute (slowloris) holds its socket forever. Here a
  connection with no request in progress is closed `header_timeout_s` after it opened or after its
  last response.
- Shutdown (SIGTERM, Ctrl-C): new requests get 503; those in flight get `drain_timeout_s`, then fail
  with an error, so every stream still ends with an error event and `data: [DONE]`.
- Engine failure (worker.failure): the server shuts down the same way and `exit_code` is 1, so a
  supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hspec.serving.limits import ServingLimits
from hspec.serving.worker import EngineWorker

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # after the drain, what failed requests get to send their answers
OVER_LIMIT = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def limited_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection bound and a request-head deadline (module docstring)."""

    class LimitedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(OVER_LIMIT)
                transport.close()  # connection_lost forgets it
                return
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_deadline)

        def _head_deadline(self) -> None:
            self._head_timer = None
            idle = self.cycle is None or self.cycle.response_complete  # no request is being answered
            if idle and not self.transport.is_closing():
                self.transport.close()

    return LimitedH11Protocol


class HspecServer(uvicorn.Server):
    """uvicorn serving an app made by `create_app` (it reads `app.state.worker` and `app.state.limits`)."""

    def __init__(self, app: Any, log_level: str = "info") -> None:
        limits: ServingLimits = app.state.limits
        self.worker: EngineWorker = app.state.worker
        self.limits = limits
        super().__init__(uvicorn.Config(
            app, log_level=log_level, lifespan="on",
            http=limited_protocol(limits.max_connections, limits.header_timeout_s),
            limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
            timeout_graceful_shutdown=limits.drain_timeout_s + SHUTDOWN_GRACE_S))  # type: ignore[arg-type]

    @property
    def exit_code(self) -> int:
        """1 once the engine has failed, else 0."""
        return 1 if self.worker.failure is not None else 0

    async def on_tick(self, counter: int) -> bool:
        if self.worker.failure is not None and not self.should_exit:
            log.error("shutting down: %s", self.worker.failure)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.close("the server is shutting down")
        drain = self.limits.drain_timeout_s
        deadline = asyncio.get_running_loop().call_later(
            drain, self.worker.abort_live, f"the server is shutting down and its drain time of {drain:g} s passed")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
