"""A request's updates from the engine thread to one HTTP response: collected whole, or sent as SSE.

Both ways watch the client while they wait: one that disconnects, streaming or not, cancels its
request within `poll_s`, which frees its KV blocks and its batch slot before the next step.
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
from hspec.serving.worker import EngineWorker

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


class RequestStream:
    """The updates of one submitted request; cancels it on leaving unless it finished.

    Use as `async with RequestStream(...) as stream: update = await stream.next()`. `next` raises
    ClientGone once `is_disconnected()` says so; leaving the block then cancels the request.
    """

    def __init__(self, worker: EngineWorker, request: Request, is_disconnected: Callable[[], Awaitable[bool]],
                 poll_s: float = DISCONNECT_POLL_S) -> None:
        self.worker, self.request, self.is_disconnected, self.poll_s = worker, request, is_disconnected, poll_s
        self.finished = False
        self._sink: asyncio.Queue[RequestUpdate] | None = None
        self._getter: asyncio.Future[RequestUpdate] | None = None
        self._next_check = 0.0  # time.monotonic() of the next look at the connection

    async def __aenter__(self) -> RequestStream:
        self._sink = self.worker.submit(self.request)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._getter is not None:
            self._getter.cancel()
        if not self.finished:  # the client went away or the handler failed: free the request's blocks
            self.worker.cancel(self.request.request_id)

    async def next(self) -> RequestUpdate:
        """The request's next update; raises ClientGone if the client disconnects first."""
        assert self._sink is not None, "use RequestStream in `async with`"
        while True:
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
            done, _ = await asyncio.wait({self._getter}, timeout=max(0.0, self._next_check - time.monotonic()))
            if done:
                update, self._getter = self._getter.result(), None
                return self._take(update)

    def _take(self, update: RequestUpdate) -> RequestUpdate:
        self.finished = update.finished
        return update


async def collect(stream: RequestStream) -> tuple[list[int], str | None]:
    """Await a request's updates to the end: its output tokens and engine finish reason."""
    tokens: list[int] = []
    async with stream:
        while True:
            update = await stream.next()
            if update.finish_reason == "error":
                raise APIError(500, update.error or "engine error", kind="server_error")
            tokens.extend(update.new_token_ids)
            if update.finished:
                return tokens, update.finish_reason


def sse_response(stream: RequestStream, decode: Callable[[list[int]], str],
                 chunk: Callable[[str, str | None], dict[str, Any]], first: dict[str, Any] | None,
                 include_usage: bool) -> StreamingResponse:
    """A Server-Sent Events response: one `data:` event per step's text, then `data: [DONE]`."""
    request = stream.request

    async def events() -> AsyncIterator[str]:
        text = TextStream(decode, request.stop)
        num_tokens = 0
        async with stream:
            if first is not None:
                yield _event(first)
            while True:
                try:
                    update = await stream.next()
                except ClientGone:
                    return  # leaving the block cancels the request
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

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
