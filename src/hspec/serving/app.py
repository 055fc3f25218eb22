"""The OpenAI-compatible FastAPI app: its routes, and how a request body becomes an engine `Request`.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
SSE streaming, `"stream": true`), GET /metrics (Prometheus text format).

Threads: uvicorn's event loop runs the handlers and does nothing slow itself. A body (at most
`max_request_bytes`, middleware.BodySizeLimit) is decoded, parsed, validated and tokenised in a worker
thread (`anyio.to_thread`), so a large one never stalls /health or other clients. One `EngineWorker`
thread owns the model, the KV pool and the engine. A handler submits its request and awaits the
updates (streaming.py); a client that goes away, streaming or not, cancels its request. The
engine's own design: docs/design.md#the-serving-engine.

Errors: every one is answered in OpenAI's envelope (errors.py): 400 for a body that does not decode,
parse or validate, a chat template that refuses the messages, or a prompt too long for the target's
context or the KV pool; 401 without the API key; 404 for an unknown model; 408 for a body that does not
arrive within --header-timeout; 413 for a body over the limit; 415 for a body not sent as JSON; 503
(with Retry-After) when the waiting queue is full, and 503 once the engine has failed or the server is
shutting down; 504 past the request's deadline. The guards and their settings: limits.py.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.step import DecodeStages
from hspec.decoding.text import cut_at_stop
from hspec.drafters.base import Drafter
from hspec.models.llama import TargetModel
from hspec.serving import protocol
from hspec.serving.engine import Engine, Request
from hspec.serving.errors import APIError, install_error_handlers, parse_body
from hspec.serving.limits import ServingLimits
from hspec.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from hspec.serving.middleware import BodySizeLimit, CountRequests, RequestGuard
from hspec.serving.streaming import DISCONNECT_POLL_S, RequestStream, collect, sse_response
from hspec.serving.worker import EngineWorker

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB of JSON: far more text than any target's context holds


class ServingTokenizer(Protocol):
    """What the server needs from a tokenizer (`models.tokenizer.ChatTokenizer` has it)."""

    eos_token_ids: tuple[int, ...]

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def build_engine(target: TargetModel, drafter: Drafter, tokenizer: ServingTokenizer, K: int,
                 kv_budget_bytes: int | None = None, num_pages: int | None = None, page_size: int = 16,
                 max_running: int = 128, speculate_max_batch: int | None = None) -> Engine:
    """An engine over a KV pool sized by a memory budget (target + drafter layers) or a page count;
    it speculates only while at most `speculate_max_batch` sequences run (None: always)."""
    if (kv_budget_bytes is None) == (num_pages is None):
        raise ValueError("give exactly one of kv_budget_bytes and num_pages")
    c = target.config
    if num_pages is not None:
        pool = target.new_pool(num_pages, page_size, drafter.num_drafter_layers)
    elif kv_budget_bytes is not None:
        pool = PagedKVPool.from_memory_budget(int(kv_budget_bytes), c.num_layers, c.num_kv_heads, c.head_dim,
                                              page_size, drafter.num_drafter_layers, target.kv_dtype,
                                              target.embed_tokens.weight.device, target.row_invariant_attention,
                                              target.kv_product_dtype)
    stages = DecodeStages(target, drafter, K, tokenizer.eos_token_ids, tokenizer.decode)
    return Engine(stages, pool, max_running, speculate_max_batch)


def engine_worker(engine: Engine, model_name: str, limits: ServingLimits | None = None) -> EngineWorker:
    """The worker thread that will run `engine` (not started), counting into new `ServingMetrics` of
    `model_name`, the engine marked broken after `limits.max_failed_steps` failed steps in a row."""
    metrics = ServingMetrics(model_name, engine.stages.drafter.kind, engine.K, engine.pool.capacity_tokens)
    return EngineWorker(engine, metrics, max_failed_steps=(limits or ServingLimits()).max_failed_steps)


def create_app(worker: EngineWorker, tokenizer: ServingTokenizer, model_name: str, default_max_tokens: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, disconnect_poll_s: float = DISCONNECT_POLL_S,
               limits: ServingLimits | None = None) -> FastAPI:
    """The FastAPI app serving `worker`'s engine (`engine_worker` makes one; a test may hand it an engine
    with faults injected); the worker thread starts and stops with the app's lifespan.

    default_max_tokens: output limit of chat requests that give none (completions: OpenAI's 16), clamped
    to the room the prompt leaves. max_request_bytes: larger bodies get 413 before they are read.
    disconnect_poll_s: how often a waiting handler checks that its client is still there. limits: access,
    backpressure, deadlines and engine failure (the HTTP server reads its connection fields); None: the
    defaults.
    """
    limits = limits or ServingLimits()
    engine, metrics = worker.engine, worker.metrics
    if metrics is None:
        raise ValueError("the app serves /metrics: give it a worker with ServingMetrics (`engine_worker`)")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(worker.stop)

    app = FastAPI(title="hspec", description="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics, app.state.limits = engine, worker, metrics, limits
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    app.add_middleware(RequestGuard, api_key=limits.api_key, allowed_hosts=limits.allowed_hosts)
    app.add_middleware(CountRequests, metrics=metrics)  # added last = outermost: refusals are counted too
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        refusal = worker.refusal
        if refusal is not None:  # failed, stopped or draining: a balancer or supervisor should look elsewhere
            return JSONResponse({"status": "unavailable", "reason": refusal}, status_code=503)
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

    def admit() -> None:
        """APIError 503 unless the engine takes a request now (the queue bound: Retry-After)."""
        refusal = worker.refusal
        if refusal is not None:
            raise APIError(503, refusal, kind="server_error", code="engine_unavailable")
        if limits.max_waiting is not None and worker.num_waiting >= limits.max_waiting:
            raise APIError(503, f"{worker.num_waiting} requests are waiting, this server's limit "
                                f"(hspec serve --max-waiting {limits.max_waiting}); retry later",
                           kind="server_error", code="queue_full", headers={"Retry-After": str(limits.retry_after_s)})

    async def read_body(http: HTTPRequest) -> bytes:
        """The request body; APIError 408 if it is not all there within --header-timeout (a client that
        trickles its body holds a socket and a handler as long as it likes otherwise)."""
        try:
            with anyio.fail_after(limits.header_timeout_s):
                return await http.body()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {limits.header_timeout_s:g} s "
                                "(hspec serve --header-timeout)") from None

    # ---- body -> engine request, in a worker thread ------------------------------------------------

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    def make_request(prefix: str, prompt_ids: list[int], body: protocol.SamplingFields, asked: int | None,
                     default: int) -> Request:
        """The engine request; without `asked` (max_tokens) the default is clamped to the room left."""
        max_tokens = asked if asked is not None else max(1, min(default, engine.room_for_output(len(prompt_ids))))
        # Without a seed, an unpredictable one: a sampled answer must not be reproducible by another client.
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        request = Request(f"{prefix}-{uuid.uuid4().hex}", tuple(prompt_ids), max_tokens, body.sampling(), seed,
                          body.stop_strings())
        try:
            engine.validate(request)
        except ValueError as err:
            raise APIError(400, str(err), param="prompt" if "prompt" in str(err) else None) from err
        return request

    def prepare_completion(raw: bytes) -> tuple[protocol.CompletionRequest, Request]:
        body = parse_body(protocol.CompletionRequest, raw)
        check_model(body.model)
        try:
            if isinstance(body.prompt, str) or isinstance(body.prompt[0], str):
                text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
                prompt_ids = tokenizer.encode_prompt(text, raw=True)
            else:
                prompt_ids = list(body.prompt)
        except Exception as err:  # the client's text, refused by the tokenizer
            raise APIError(400, f"the prompt cannot be tokenised: {err}", param="prompt") from err
        return body, make_request("cmpl", prompt_ids, body, body.max_tokens,
                                  protocol.CompletionRequest.DEFAULT_MAX_TOKENS)

    def prepare_chat(raw: bytes) -> tuple[protocol.ChatCompletionRequest, Request]:
        body = parse_body(protocol.ChatCompletionRequest, raw)
        check_model(body.model)
        try:
            prompt_ids = tokenizer.encode_chat(body.conversation())
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        except Exception as err:  # a chat template's own check (jinja2's TemplateError: roles out of order...)
            raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from err
        return body, make_request("chatcmpl", prompt_ids, body, body.requested_max_tokens(), default_max_tokens)

    # ---- generation routes ---------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Any:
        body, request = await anyio.to_thread.run_sync(prepare_completion, await read_body(http))
        admit()
        stream = RequestStream(worker, request, http.is_disconnected, disconnect_poll_s, limits.request_timeout_s)

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return protocol.completion_chunk(request.request_id, created, model_name, text, finish)

        if body.stream:
            return sse_response(stream, tokenizer.decode, chunk, None, body.include_usage)
        tokens, reason = await collect(stream)
        text = cut_at_stop(tokenizer.decode(tokens), request.stop)
        return protocol.completion_body(request.request_id, created, model_name, text,
                                        protocol.openai_finish_reason(reason), len(request.prompt_ids), len(tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Any:
        body, request = await anyio.to_thread.run_sync(prepare_chat, await read_body(http))
        admit()
        stream = RequestStream(worker, request, http.is_disconnected, disconnect_poll_s, limits.request_timeout_s)

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            delta = {"content": text} if text or finish is None else {}
            return protocol.chat_chunk(request.request_id, created, model_name, delta, finish)

        if body.stream:
            first = protocol.chat_chunk(request.request_id, created, model_name,
                                        {"role": "assistant", "content": ""}, None)
            return sse_response(stream, tokenizer.decode, chunk, first, body.include_usage)
        tokens, reason = await collect(stream)
        text = cut_at_stop(tokenizer.decode(tokens), request.stop)
        return protocol.chat_body(request.request_id, created, model_name, text,
                                  protocol.openai_finish_reason(reason), len(request.prompt_ids), len(tokens))

    return app
