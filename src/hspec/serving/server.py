"""The OpenAI-compatible HTTP server: FastAPI app factory, uvicorn runners.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
SSE streaming, `"stream": true`), GET /metrics (Prometheus text format).

Threads: uvicorn's event loop runs the handlers; one `EngineWorker` thread owns the model, the KV pool
and the engine (DESIGN.md §2). A handler tokenises and validates, submits the request and awaits
its updates; a client that goes away cancels its request, which frees its KV blocks.

Errors: a body that does not parse or validate, an unknown model, a prompt too long for the target's
context or the KV pool each get a 4xx with an OpenAI-style `{"error": {"message": ...}}` body;
the server keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.step import DecodeStages
from hspec.drafters.base import Drafter
from hspec.models.llama import TargetModel
from hspec.serving import protocol
from hspec.serving.engine import Engine, Request, RequestUpdate
from hspec.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from hspec.serving.worker import EngineWorker

log = logging.getLogger(__name__)

_COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServingTokenizer(Protocol):
    """What the server needs from a tokenizer (`models.tokenizer.ChatTokenizer` has it)."""

    eos_token_ids: tuple[int, ...]

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class APIError(Exception):
    """An error answered with `status` and OpenAI's error envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def build_engine(target: TargetModel, drafter: Drafter, tokenizer: ServingTokenizer, K: int,
                 kv_budget_bytes: int | None = None, num_blocks: int | None = None, block_size: int = 16,
                 max_running: int = 128) -> Engine:
    """An engine over a KV pool sized by a memory budget (target + drafter layers) or a block count."""
    if (kv_budget_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of kv_budget_bytes and num_blocks")
    c = target.config
    weight = target.embed_tokens.weight
    if num_blocks is not None:
        pool = target.new_pool(num_blocks, block_size, drafter.num_pool_layers)
    else:
        pool = PagedKVPool.from_memory_budget(int(kv_budget_bytes), c.num_layers, c.num_kv_heads, c.head_dim,
                                              block_size, drafter.num_pool_layers, weight.dtype, weight.device)
    stages = DecodeStages(target, drafter, K, tokenizer.eos_token_ids, tokenizer.decode)
    return Engine(stages, pool, max_running)


def create_app(engine: Engine, tokenizer: ServingTokenizer, model_name: str, default_max_tokens: int = 256
               ) -> FastAPI:
    """The FastAPI app serving `engine`; its worker thread starts and stops with the app's lifespan."""
    metrics = ServingMetrics(model_name, engine.stages.drafter.kind, engine.K, engine.pool.capacity_tokens)
    worker = EngineWorker(engine, metrics)
    created = int(time.time())
    seeds = itertools.count()  # default seed of a request that brings none: its arrival number

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="hspec", description="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(_, err: APIError) -> JSONResponse:
        return JSONResponse(protocol.error_body(err.message, err.kind, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return JSONResponse(protocol.error_body(message, param=param), status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "hspec",
            "drafter": engine.stages.drafter.kind, "K": engine.K,
            "kv_capacity_tokens": engine.pool.capacity_tokens}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    def make_request(prefix: str, prompt_ids: list[int], body: protocol.SamplingFields, max_tokens: int) -> Request:
        seed = body.seed if body.seed is not None else next(seeds)
        request = Request(f"{prefix}-{uuid.uuid4().hex}", tuple(prompt_ids), max_tokens, body.sampling(), seed,
                          body.stop_strings())
        try:
            engine.validate(request)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt" if "prompt" in str(err) else None) from err
        return request

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest) -> Any:
        check_model(body.model)
        try:
            if isinstance(body.prompt, str) or isinstance(body.prompt[0], str):
                text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
                prompt_ids = tokenizer.encode_prompt(text, raw=True)
            else:
                prompt_ids = list(body.prompt)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from err
        request = make_request("cmpl", prompt_ids, body, body.max_tokens)

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return protocol.completion_chunk(request.request_id, created, model_name, text, finish)

        if body.stream:
            return _sse(worker, request, tokenizer, chunk, None, body.include_usage)
        tokens, reason = await _collect(worker, request)
        text = _cut_at_stop(tokenizer.decode(tokens), request.stop)
        return protocol.completion_body(request.request_id, created, model_name, text,
                                        protocol.openai_finish_reason(reason), len(prompt_ids), len(tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest) -> Any:
        check_model(body.model)
        try:
            prompt_ids = tokenizer.encode_chat(body.conversation())
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        request = make_request("chatcmpl", prompt_ids, body, body.token_limit(default_max_tokens))

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            delta = {"content": text} if text or finish is None else {}
            return protocol.chat_chunk(request.request_id, created, model_name, delta, finish)

        if body.stream:
            first = protocol.chat_chunk(request.request_id, created, model_name,
                                        {"role": "assistant", "content": ""}, None)
            return _sse(worker, request, tokenizer, chunk, first, body.include_usage)
        tokens, reason = await _collect(worker, request)
        text = _cut_at_stop(tokenizer.decode(tokens), request.stop)
        return protocol.chat_body(request.request_id, created, model_name, text,
                                  protocol.openai_finish_reason(reason), len(prompt_ids), len(tokens))

    return app


# ---- request plumbing ---------------------------------------------------------------------------


async def _collect(worker: EngineWorker, request: Request) -> tuple[list[int], str | None]:
    """Await a request's updates to the end; cancel it if this handler is cancelled."""
    sink = worker.submit(request)
    tokens: list[int] = []
    finished = False
    try:
        while True:
            update = await sink.get()
            _raise_if_error(update)
            tokens.extend(update.new_token_ids)
            if update.finished:
                finished = True
                return tokens, update.finish_reason
    finally:
        if not finished:
            worker.cancel(request.request_id)


def _sse(worker: EngineWorker, request: Request, tokenizer: ServingTokenizer,
         chunk: Callable[[str, str | None], dict[str, Any]], first: dict[str, Any] | None,
         include_usage: bool) -> StreamingResponse:
    """A Server-Sent Events response: one `data:` event per step's text, then `data: [DONE]`."""
    async def events() -> AsyncIterator[str]:
        sink = worker.submit(request)
        stream = TextStream(tokenizer.decode, request.stop)
        finished = False
        num_tokens = 0
        try:
            if first is not None:
                yield _event(first)
            while True:
                update = await sink.get()
                if update.finish_reason == "error":
                    finished = True
                    yield _event(protocol.error_body(update.error or "engine error", "server_error"))
                    break
                num_tokens = update.num_output_tokens
                delta = stream.push(update.new_token_ids, update.finished)
                if delta:
                    yield _event(chunk(delta, None))
                if update.finished:
                    finished = True
                    yield _event(chunk("", protocol.openai_finish_reason(update.finish_reason)))
                    if include_usage:
                        body = chunk("", None)
                        body.update(choices=[], usage=protocol.usage(len(request.prompt_ids), num_tokens))
                        yield _event(body)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free the request's blocks
                worker.cancel(request.request_id)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _raise_if_error(update: RequestUpdate) -> None:
    if update.finish_reason == "error":
        raise APIError(500, update.error or "engine error", kind="server_error")


class TextStream:
    """Incremental detokenisation: text deltas that never need to be taken back.

    Decodes the whole output each time and sends what is new, holding back an incomplete UTF-8
    character (U+FFFD at the end) and, with stop strings, the last len(longest stop) - 1 characters,
    which could be the start of a stop string that the final text must not contain.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, new_token_ids: Sequence[int], finished: bool) -> str:
        """Add tokens; return the text delta that is now safe to send."""
        self.token_ids.extend(new_token_ids)
        text = self.decode(self.token_ids)
        if finished:
            text = _cut_at_stop(text, self.stop)
        else:
            text = text.rstrip("\ufffd")
            text = text[: max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):  # a tokenizer that rewrote earlier text: wait for it to settle
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the first offending parameter."""
    parts, param = [], None
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5]), param


class _CountRequests:
    """Pure-ASGI middleware counting HTTP requests by path and status (streaming-safe)."""

    def __init__(self, app: Any, metrics: ServingMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in _COUNTED_PATHS else "other"

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)


# ---- running it ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeSettings:
    """What `hspec serve` runs."""

    target: str = "smollm2"  # checkpoint dir, .gguf or the embedded default's name
    drafter: str = "ngram"  # drafter kind; "none" = plain decoding
    K: int = 7  # tokens drafted per step
    drafter_path: str | None = None  # a trained checkpoint (default: the one shipped for the target)
    kv_budget_mib: float | None = 512.0  # KV pool memory (target + drafter layers); or give kv_blocks
    kv_blocks: int | None = None
    block_size: int = 16
    max_running: int = 128  # largest decoding batch
    model_name: str | None = None  # the id clients send as `model` (default: the target's name)
    default_max_tokens: int = 256  # chat requests without max_tokens
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    random_drafter_weights: bool = False  # an untrained drafter: for timing and KV accounting only


def serve(settings: ServeSettings) -> None:
    """Load the target and drafter, build the engine and serve until interrupted."""
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter

    if settings.threads:
        torch.set_num_threads(settings.threads)  # this process's setting, made once by its entry point
    target = load_target(settings.target)
    drafter = build_drafter(settings.drafter, target, settings.drafter_path, settings.random_drafter_weights)
    if settings.random_drafter_weights and getattr(drafter, "needs_target_model", False):
        log.warning("serving an untrained %r drafter (random weights): outputs stay exact, acceptance is "
                    "meaningless", settings.drafter)
    blocks = settings.kv_blocks
    budget = None if blocks is not None else int((settings.kv_budget_mib or 512.0) * (1 << 20))
    engine = build_engine(target.model, drafter, target.tokenizer, settings.K, budget, blocks, settings.block_size,
                          settings.max_running)
    name = settings.model_name or target.name
    print(f"[hspec serve] {name} with drafter {drafter.kind} (K={engine.K}), KV pool {engine.pool.capacity_tokens} "
          f"tokens, on http://{settings.host}:{settings.port}", flush=True)
    run_server(create_app(engine, target.tokenizer, name, settings.default_max_tokens), settings.host,
               settings.port, settings.log_level)


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C), in this thread."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ServerThread:
    """uvicorn in a background thread on a socket bound here (port 0 = a free one): for tests/benches.

    Use as a context manager; `url` is the base URL. Binds loopback by default.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="hspec-http", daemon=True)
        self.start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()
