"""Pure-ASGI middleware: a request-body size limit and per-path request counting.

Pure ASGI (not Starlette's `BaseHTTPMiddleware`) so neither buffers a body nor delays a stream.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from hspec.serving import protocol
from hspec.serving.metrics import ServingMetrics

COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class BodySizeLimit:
    """Refuse request bodies over `max_bytes` with 413, before they are read whole.

    A declared Content-Length over the limit is answered at once, without reading a byte of the body;
    a chunked body (no Content-Length) is counted as it arrives, and reading it stops with a 413 as
    soon as it passes the limit. Either way the connection is closed after the answer, so the rest of
    the upload is never read: letting the HTTP server read and discard it instead (keep-alive) costs
    the event loop 0.5-3 s for 50 MB, during which /health waits too. A client that sends its whole
    body before reading (no `Expect: 100-continue`) may then see the connection reset instead of the
    413 on a busy machine; curl, which waits for 100-continue on large bodies, gets the 413 at once.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, 413, f"the request body has {declared} bytes, more than this server's limit of "
                                         f"{self.max_bytes} bytes (hspec serve --max-request-bytes)")
            return
        received = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes through FastAPI's body reading untouched and is answered by
                    # errors.install_error_handlers in the envelope.
                    raise HTTPException(413, f"the request body is larger than this server's limit of "
                                             f"{self.max_bytes} bytes (hspec serve --max-request-bytes)",
                                        headers={"Connection": "close"})
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server itself refuses a malformed length
    return None


async def _send_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(protocol.error_body(message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class CountRequests:
    """Count HTTP requests by path and status (streaming-safe: counts at the response's start)."""

    def __init__(self, app: Any, metrics: ServingMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in COUNTED_PATHS else "other"

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)
