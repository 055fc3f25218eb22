"""`hspec serve`: the OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import sys

from hspec.cli.command import Command
from hspec.cli.options import (
    add_decoding_options,
    add_drafter,
    add_dtype,
    add_pool_options,
    add_renamed,
    add_target,
    drafter_args,
)


def serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000,
                       help="TCP port in 0..65535 (default 8000; 0 = any free port, announced at start)")
    add_target(serve)
    add_dtype(serve)
    add_drafter(serve, "ngram")
    add_pool_options(serve, default_budget_mib=512.0)
    serve.add_argument("--spec-max-batch", type=int, default=None, metavar="N",
                       help="speculate only while at most N sequences run, plain decoding steps above (default: "
                            "always speculate; 0: never). Where a batch already fills the compute, as on a small "
                            "CPU, verifying K+1 tokens per sequence costs nearly K+1 plain steps "
                            "(docs/fast-path.md#speculation-and-batch-size)")
    serve.add_argument("--kv-pages", type=int, default=None,
                       help="pool size in pages, >= 1 (overrides --kv-budget-mib); a pool that cannot hold one "
                            "request is refused, one that cannot give a request --default-max-tokens is warned of")
    add_renamed(serve, "--kv-blocks", "--kv-pages")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="largest request body in bytes (default 1048576 = 1 MiB); larger ones get 413 "
                            "before they are read")
    serve.add_argument("--served-model-name", default=None, help="the `model` id clients send (default: target name)")
    serve.add_argument("--default-max-tokens", type=int, default=256,
                       help="output limit of chat requests that give none, clamped to the room the prompt leaves "
                            "in the context and the KV pool (default 256; completions: OpenAI's 16, clamped too)")
    serve.add_argument("--random-drafter-weights", action="store_true",
                       help="serve a trained kind untrained (exact outputs, meaningless acceptance; for timing)")
    add_decoding_options(serve)
    serve.add_argument("--threads", type=int, default=0,
                       help="torch CPU threads (default 0 = torch's default; 1 is faster on a busy machine)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_serve_limits(serve)


def add_serve_limits(serve: argparse.ArgumentParser) -> None:
    """`hspec serve`'s access, backpressure, deadline and connection flags (hspec.serving.limits)."""
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="clients must send `Authorization: Bearer KEY` on /v1/* (default: the HSPEC_API_KEY "
                            "environment variable, which `ps` does not show; unset = open, with a warning when "
                            "--host is not loopback)")
    serve.add_argument("--max-waiting", type=int, default=None, metavar="N",
                       help="answer 503 with Retry-After while N requests wait for the engine (default: no bound)")
    serve.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="fail a request that has not finished this long after it arrived, queue time "
                            "included (default: none)")
    serve.add_argument("--max-failed-steps", type=int, default=3, metavar="N",
                       help="after N engine steps fail in a row the server answers 503, fails what is queued and "
                            "exits with status 1 for a supervisor to restart it (default 3)")
    serve.add_argument("--max-connections", type=int, default=1024, metavar="N",
                       help="open connections; more are answered 503 and closed (default 1024)")
    serve.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="close a connection that sends no complete request head for this long; a request "
                            "body not all there by then gets 408 (default 10)")
    serve.add_argument("--keep-alive-timeout", type=int, default=5, metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (default 5)")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, requests in flight get this long to finish; then each fails with an "
                            "error (streams: an error event and [DONE]) (default 30)")


def run_serve(args: argparse.Namespace) -> int:
    """Serve the target with a drafter over an OpenAI-compatible HTTP API."""
    import os

    from hspec.serving.limits import ServingLimits
    from hspec.serving.server import ServeSettings, require_serve_extra, serve

    drafter_args(args)
    limits = ServingLimits(
        api_key=args.api_key if args.api_key is not None else os.environ.get("HSPEC_API_KEY") or None,
        max_waiting=args.max_waiting, request_timeout_s=args.request_timeout, max_failed_steps=args.max_failed_steps,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout,
        keep_alive_s=args.keep_alive_timeout, drain_timeout_s=args.drain_timeout)
    settings = ServeSettings(  # checks every value, naming its flag, before anything loads
        target=args.target, drafter=args.drafter, K=args.k, drafter_path=args.drafter_path,
        kv_budget_mib=args.kv_budget_mib, kv_pages=args.kv_pages, page_size=args.page_size,
        max_running=args.max_running, speculate_max_batch=args.spec_max_batch, model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=args.max_request_bytes, host=args.host, port=args.port, log_level=args.log_level,
        threads=args.threads, random_drafter_weights=args.random_drafter_weights, dtype=args.dtype,
        drafter_options=tuple(args.drafter_option), limits=limits)
    try:
        require_serve_extra()
    except ImportError as err:
        print(f"hspec: error: {err}", file=sys.stderr)
        return 2
    return serve(settings)


COMMANDS = (
    Command("serve", "OpenAI-compatible HTTP server with continuous batching", serve_arguments, run_serve,
            description="Serve the target with speculative decoding over a paged KV pool: /v1/models, "
                        "/v1/completions and /v1/chat/completions (SSE streaming with \"stream\": true), /metrics "
                        "(Prometheus) and /health. Requests are batched continuously; when the pool is full they "
                        "wait, or the youngest is preempted and later recomputed; output equals the target's own. A "
                        "client that disconnects cancels its request. Every error comes in OpenAI's envelope. "
                        "Extension: `top_k` in request bodies."),
)
