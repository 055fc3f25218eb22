"""A request's updates from the engine thread to one HTTP response: collected whole, or sent as SSE.

Both ways watch the client while they wait: one that disconnects, streaming or not, cancels its
request within `poll_s`, which frees its KV pages and its batch slot before the next step. Both
also watch the request's deadline (`hspec serve --request-timeout`): past it the request is
cancelled and answered with an error, never left hanging. A stream always ends with `data: [DONE]`,
after an error event when the request failed (engine error, deadline, shutdown).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from hspec.decoding.text import TextStream
from hspec.serving import protocol
from hspec.serving.engine import Request, RequestUpdate
from hspec.serving.errors import APIError, ClientGone
from hspec.serving.worker import EngineUnavailable, EngineWorker

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


class RequestTimeout(Exception):
    """A request passed its deadline before it finished."""


class RequestStream:
    """The updates of one submitted request; cancels it on leaving unless it finished.

    Use as `async with RequestStream(...) as stream: update = await stream.next()`. Entering raises
    EngineUnavailable when the engine takes no new requests. `next` raises ClientGone once
    `is_disconnected()` says so, and RequestTimeout `timeout_s` seconds after the request was made
    (None: never); leaving the block then cancels the request.
    """

    def __init__(self, worker: EngineWorker, request: Request, is_disconnected: Callable[[], Awaitable[bool]],
                 poll_s: float = DISCONNECT_POLL_S, timeout_s: float | None = None) -> None:
        self.worker, self.request, self.is_disconnected, self.poll_s = worker, request, is_disconnected, poll_s
        self.timeout_s = timeout_s
        self.deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
        self.finished = False
        self._sink: asyncio.Queue[RequestUpdate] | None = None
        self._getter: asyncio.Future[RequestUpdate] | None = None
        self._next_check = 0.0  # time.monotonic() of the next look at the connection

    async def __aenter__(self) -> RequestStream:
        self.submit()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def submit(self) -> None:
        """Hand the request to the engine (EngineUnavailable if it takes none)."""
        self._sink = self.worker.submit(self.request)

    def close(self) -> None:
        """Stop waiting; cancel the request unless it finished."""
        if self._getter is not None:
            self._getter.cancel()
        if self._sink is not None and not self.finished:  # the client went away, the deadline passed or the
            self.worker.cancel(self.request.request_id)  # handler failed: free the request's pages

    async def next(self) -> RequestUpdate:
        """The request's next update; raises ClientGone if the client disconnects first, RequestTimeout
        if the deadline passes first."""
        assert self._sink is not None, "use RequestStream in `async with`"
        while True:
            if time.monotonic() >= self.deadline:
                raise RequestTimeout(f"the request did not finish within {self.timeout_s:g} s "
                                     "(hspec serve --request-timeout)")
            # Checked by the clock, not only when no update came: a running request's updates arrive
            # every step, faster than poll_s.
            if time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + self.poll_s
                if await self.is_disconnected():
                    raise ClientGone(self.request.request_id)
            if self._getter is None:
                try:  # an update already queued: no task to make (the common case under load)
                    return self._take(self._sink.get_nowait())
                except asyncio.QueueEmpty:
                    self._getter = asyncio.ensure_future(self._sink.get())
            # One pending get survives the polls, so an update that arrives between two polls is never lost.
            wake = min(self._next_check, self.deadline)
            done, _ = await asyncio.wait({self._getter}, timeout=max(0.0, wake - time.monotonic()))
            if done:
                update, self._getter = self._getter.result(), None
                return self._take(update)

    def _take(self, update: RequestUpdate) -> RequestUpdate:
        self.finished = update.finished
        return update


async def collect(stream: RequestStream) -> tuple[list[int], str | None]:
    """Await a request's updates to the end: its output tokens and engine finish reason.

    APIError 503 when the engine takes no requests (it failed, or the server is shutting down), 504
    past the deadline, 500 when the engine failed on this request.
    """
    tokens: list[int] = []
    try:
        async with stream:
            while True:
                update = await stream.next()
                if update.finish_reason == "error":
                    status = 503 if stream.worker.refusal is not None else 500
                    raise APIError(status, update.error or "engine error", kind="server_error")
                tokens.extend(update.new_token_ids)
                if update.finished:
                    return tokens, update.finish_reason
    except EngineUnavailable as err:
        raise APIError(503, str(err), kind="server_error", code="engine_unavailable") from None
    except RequestTimeout as err:
        raise APIError(504, str(err), kind="server_error", code="timeout") from None


def sse_response(stream: RequestStream, decode: Callable[[list[int]], str],
                 chunk: Callable[[str, str | None], dict[str, Any]], first: dict[str, Any] | None,
                 include_usage: bool) -> StreamingResponse:
    """A Server-Sent Events response: one `data:` event per step's text, then `data: [DONE]`."""
    request = stream.request

    async def events() -> AsyncIterator[str]:
        text = TextStream(decode, request.stop)
        num_tokens = 0
        try:
            stream.submit()
        except EngineUnavailable as err:  # refused between the route's check and here
            yield _event(protocol.error_body(str(err), "server_error", code="engine_unavailable"))
            yield "data: [DONE]\n\n"
            return
        try:
            if first is not None:
                yield _event(first)
            while True:
                try:
                    update = await stream.next()
                except ClientGone:
                    return  # leaving the block cancels the request
                except RequestTimeout as err:
                    yield _event(protocol.error_body(str(err), "server_error", code="timeout"))
                    break
                if update.finish_reason == "error":
                    yield _event(protocol.error_body(update.error or "engine error", "server_error"))
                    break
                num_tokens = update.num_output_tokens
                delta = text.push(update.new_token_ids, update.finished)
                if delta:
                    yield _event(chunk(delta, None))
                if update.finished:
                    yield _event(chunk("", protocol.openai_finish_reason(update.finish_reason)))
                    if include_usage:
                        body = chunk("", None)
                        body.update(choices=[], usage=protocol.usage(len(request.prompt_ids), num_tokens))
                        yield _event(body)
                    break
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
