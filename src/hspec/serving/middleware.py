"""Pure-ASGI middleware: who may ask (Host, API key, Content-Type), a body size limit, request counting.

Pure ASGI (not Starlette's `BaseHTTPMiddleware`) so none buffers a body nor delays a stream.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException

from hspec.serving import protocol
from hspec.serving.limits import host_name
from hspec.serving.metrics import ServingMetrics

COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class RequestGuard:
    """Refuse, before the app sees them, requests a browser page or a stranger could send.

    1. Host (when `allowed_hosts` is given): a loopback server answers only Host names it knows, so a
       web page whose name an attacker re-points at 127.0.0.1 (DNS rebinding) cannot read its answers:
       400. A request without Host (HTTP/1.0) passes: browsers always send one.
    2. API key (when given): `/v1/*` needs `Authorization: Bearer <key>`, compared in constant time:
       401. /health and /metrics stay open, as in vLLM, for probes and scrapers.
    3. Content-Type: a POST body is parsed only when declared `application/json`: 415. A page can POST
       `text/plain` to any address without a CORS preflight; it cannot send `application/json`.
    """

    def __init__(self, app: Any, api_key: str | None = None, allowed_hosts: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.allowed_hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, headers = refusal
            await _send_error(send, status, message, headers)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict[str, Any]) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        headers = dict(scope.get("headers", ()))
        host = headers.get(b"host")
        if self.allowed_hosts is not None and host is not None:
            name = host_name(host.decode("latin-1"))
            if name not in self.allowed_hosts:
                return 400, (f"Host {name!r} is not served here; a server bound to loopback answers "
                             f"{', '.join(sorted(self.allowed_hosts))} (with any port)"), []
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return 401, ("missing or wrong API key: send the server's --api-key as "
                             "`Authorization: Bearer <key>`"), [(b"www-authenticate", b"Bearer")]
        if scope.get("method") == "POST":
            declared = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if declared != b"application/json":
                shown = declared.decode("latin-1") or "none"
                return 415, (f"request bodies must be JSON sent with Content-Type: application/json, got "
                             f"{shown!r}"), []
        return None


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


async def _send_error(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
                      ) -> None:
    """An error in OpenAI's envelope, closing the connection after it: the body is never read."""
    body = json.dumps(protocol.error_body(message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or ())]})
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
