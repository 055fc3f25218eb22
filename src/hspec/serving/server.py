"""Running the HTTP server: `hspec serve`'s settings and start-up, and a background-thread server for tests.

The app itself is in app.py. This module imports no web framework at import time, so the command
line can tell a user without the `[serve]` extra what to install (`require_serve_extra`).

Start-up order: check the settings, bind the socket (a port in use fails in a second, not after the
model loads; port 0 picks a free one, and the announcement names it), load the target and the drafter,
build the engine, check that its KV pool can run a request at all, announce, serve. A server bound to
loopback answers only loopback Host names (limits.py); one bound elsewhere without an API key is
warned of. `serve` returns the process's exit status: 1 when the engine failed (http_server.py).
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from hspec.cache.paged_pool import pages_for
from hspec.models.dtype import DTYPE_CHOICES
from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits, is_loopback

if TYPE_CHECKING:
    from fastapi import FastAPI

    from hspec.models.loading import Target
    from hspec.serving.engine import Engine

log = logging.getLogger(__name__)

SERVE_EXTRA_MODULES = ("fastapi", "uvicorn", "prometheus_client")  # what `pip install 'hspec[serve]'` brings


@dataclass(frozen=True)
class ServeSettings:
    """What `hspec serve` runs; errors name the command-line flag."""

    target: str = "smollm2"  # checkpoint dir, .gguf or the embedded default's name
    drafter: str = "ngram"  # drafter kind; "none" = plain decoding
    K: int = 7  # tokens drafted per step
    drafter_path: str | None = None  # a trained checkpoint (default: the one shipped for the target)
    kv_budget_mib: float = 512.0  # KV pool memory (target + drafter layers), used when kv_pages is None
    kv_pages: int | None = None  # KV pool size in pages (overrides kv_budget_mib)
    page_size: int = 16
    max_running: int = 128  # largest decoding batch
    speculate_max_batch: int | None = None  # speculate only while at most this many sequences run (None: always)
    model_name: str | None = None  # the id clients send as `model` (default: the target's name)
    default_max_tokens: int = 256  # chat requests without max_tokens (clamped to the room the prompt leaves)
    max_request_bytes: int = 1 << 20  # larger request bodies get 413 before they are read
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the announcement names it)
    log_level: str = "info"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    random_drafter_weights: bool = False  # an untrained drafter: for timing and KV accounting only
    dtype: str = "auto"  # weights, KV pool and drafter: auto, float32 or bfloat16 (hspec.models.dtype)
    drafter_options: tuple[str, ...] = ()  # --drafter-option KEY=VALUE: decoding options of a trained drafter
    limits: ServingLimits = field(default_factory=ServingLimits)  # access, backpressure, deadlines, connections

    def __post_init__(self) -> None:
        from hspec.runtime import decoding_options_of

        decoding_options_of([self.drafter], self.drafter_options)  # a bad one fails here, naming itself
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.K < 1:
            raise ValueError(f"--k must be >= 1, got {self.K}")
        if self.kv_pages is None and not self.kv_budget_mib > 0:  # also refuses NaN
            raise ValueError(f"--kv-budget-mib must be > 0 (MiB of KV memory), got {self.kv_budget_mib:g}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError(f"--kv-pages must be >= 1, got {self.kv_pages}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_running < 1:
            raise ValueError(f"--max-running must be >= 1, got {self.max_running}")
        if self.speculate_max_batch is not None and self.speculate_max_batch < 0:
            raise ValueError(f"--spec-max-batch must be >= 0 (0: never speculate), got {self.speculate_max_batch}")
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (0 = any free port), got {self.port}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {self.threads}")


def require_serve_extra() -> None:
    """Raise ImportError saying what to install when the server's dependencies are missing."""
    missing = [name for name in SERVE_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"hspec serve needs {', '.join(missing)}, which come with the serve extra: "
                          "pip install 'hspec[serve]'")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); port 0 = a free one. ValueError naming the address on failure."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def check_pool(engine: Engine, default_max_tokens: int) -> str | None:
    """Raise ValueError if the engine's KV pool cannot run any request; a warning if it cannot run a
    request with `default_max_tokens` new tokens; None if it can.

    A request holds prompt + max_tokens + `draft_positions(K)` + 1 positions at most (`DecodeStages.positions_needed`).
    """
    pool, positions = engine.pool, engine.stages.positions_needed
    pages = f"{pool.num_pages} page" + ("s" if pool.num_pages != 1 else "")
    held = f"the KV pool holds {pool.capacity_tokens} tokens ({pages} of {pool.page_size})"
    smallest = pages_for(positions(1, 1), pool.page_size)
    if pool.num_pages < smallest:
        raise ValueError(f"{held}, too few for any request: a 1-token prompt with max_tokens=1 needs "
                         f"{positions(1, 1)} positions at K={engine.K}; give --kv-pages >= {smallest} "
                         "or a larger --kv-budget-mib")
    useful = pages_for(positions(1, default_max_tokens), pool.page_size)
    if pool.num_pages < useful:
        return (f"{held}: prompt + max_tokens must stay <= {engine.room_for_output(0)} tokens, so no request "
                f"can get the default {default_max_tokens} new tokens; --kv-pages >= {useful} (or a larger "
                "--kv-budget-mib) serves one")
    return None


def access_limits(host: str, limits: ServingLimits) -> tuple[ServingLimits, str | None]:
    """`limits` for a server bound to `host`: on loopback only loopback Host names are answered (a web page
    re-pointing its own name at 127.0.0.1, DNS rebinding, gets 400); elsewhere a warning when no API key
    guards it."""
    if is_loopback(host):
        return (replace(limits, allowed_hosts=LOOPBACK_NAMES) if limits.allowed_hosts is None else limits), None
    if limits.api_key is None:
        return limits, (f"listening on {host}, beyond this machine, without an API key: anyone who can reach the "
                        "port can use it; give --api-key (or HSPEC_API_KEY)")
    return limits, None


def open_server(settings: ServeSettings, target: Target | None = None) -> tuple[FastAPI, socket.socket, str]:
    """Bind, load the target and drafter, build and check the engine: the app, its bound socket and the
    line announcing where it serves. Nothing serves until `run_server`.

    `target`: the target `settings.target` names, already loaded (`settings.dtype` is then not used);
    None loads it.
    """
    require_serve_extra()
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter, decoding_options_of
    from hspec.serving.app import build_engine, create_app, engine_worker

    if settings.threads:
        torch.set_num_threads(settings.threads)  # this process's setting, made once by its entry point
    sock = bind_socket(settings.host, settings.port)
    try:
        if target is None:
            target = load_target(settings.target, dtype=settings.dtype)
        options = decoding_options_of([settings.drafter], settings.drafter_options)[settings.drafter]
        drafter = build_drafter(settings.drafter, target, settings.drafter_path, settings.random_drafter_weights,
                                options=options, K=max(settings.K, 1))
        if settings.random_drafter_weights and drafter.needs_target_model:
            log.warning("serving an untrained %r drafter (random weights): outputs stay exact, acceptance is "
                        "meaningless", settings.drafter)
        pages = settings.kv_pages
        budget = None if pages is not None else int(settings.kv_budget_mib * (1 << 20))
        engine = build_engine(target.model, drafter, target.tokenizer, settings.K, budget, pages,
                              settings.page_size, settings.max_running,
                              settings.speculate_max_batch)
        warning = check_pool(engine, settings.default_max_tokens)
        if warning:
            print(f"[hspec serve] warning: {warning}", file=sys.stderr, flush=True)
        name = settings.model_name or target.name
        limits, warning = access_limits(settings.host, settings.limits)
        if warning:
            print(f"[hspec serve] warning: {warning}", file=sys.stderr, flush=True)
        app = create_app(engine_worker(engine, name, limits), target.tokenizer, name, settings.default_max_tokens,
                         settings.max_request_bytes, limits=limits)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    limit = settings.speculate_max_batch
    speculating = "" if limit is None or not engine.K else f", speculating while at most {limit} sequences run"
    announcement = (f"[hspec serve] {name} with drafter {drafter.kind} (K={engine.K}{speculating}), KV pool "
                    f"{engine.pool.capacity_tokens} tokens, on http://{shown}:{port}")
    return app, sock, announcement


def serve(settings: ServeSettings) -> int:
    """Load the target and drafter, build the engine and serve until interrupted; the exit status."""
    app, sock, announcement = open_server(settings)
    print(announcement, flush=True)
    return run_server(app, sock, settings.log_level)


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info") -> int:
    """Serve `app` (made by `create_app`) on the bound `sock` until interrupted (Ctrl-C, SIGTERM) or its
    engine fails, in this thread; returns the exit status: 1 if the engine failed, else 0."""
    from hspec.serving.http_server import HspecServer

    server = HspecServer(app, log_level)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return server.exit_code


class ServerThread:
    """uvicorn in a background thread on a socket bound here (port 0 = a free one): for tests/benches.

    Use as a context manager; `url` is the base URL. Binds loopback by default, or serves on `sock`, a
    socket already bound (`open_server`'s); the socket is closed on exit.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0,
                 sock: socket.socket | None = None) -> None:
        from hspec.serving.http_server import HspecServer

        self._socket = sock if sock is not None else bind_socket(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        self.server = HspecServer(app, log_level="warning")
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
        self._thread.join(30 + self.server.limits.drain_timeout_s)
        self._socket.close()

    def wait(self, timeout_s: float) -> bool:
        """Wait until the server has stopped by itself (its engine failed); True if it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
