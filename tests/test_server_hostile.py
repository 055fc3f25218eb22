"""The server under hostile use, live on loopback: huge bodies, bad bytes, clients that leave.

Each test drives a real server (uvicorn thread -> FastAPI -> engine thread) over a tiny random
target; raw sockets where the exact bytes on the wire matter (a body that is never sent whole).
Every wait is bounded by a deadline.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from conftest import build_tiny_checkpoint, load_tiny
from hspec.serving.app import DEFAULT_MAX_REQUEST_BYTES, build_engine, create_app, engine_worker
from hspec.serving.server import ServerThread
from serving_helpers import MODEL, ChatByteTokenizer, K, start_server

CONTEXT = 512  # the tiny target's context (conftest's default)


@pytest.fixture(scope="module")
def chat_target(tiny_dirs):
    """Conftest's, with a tokenizer whose EOS the target never emits: every request runs to max_tokens (also
    on conftest's `server`, which serves this)."""
    target = load_tiny(tiny_dirs["llama"])
    target.tokenizer = ChatByteTokenizer(target.config.vocab_size, eos=target.config.vocab_size)
    return target


def _metric(url: str, name: str) -> float:
    """One sample of /metrics; 0 when absent (a labelled series appears on first use)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def _health_seconds(url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    return time.perf_counter() - start


def _read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict]:
    """Status and JSON body of the HTTP response on `sock` (the server closes the connection after it)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _response_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.I)
    return len(head) + 4 + int(match.group(1)) if match else 1 << 62


# ---- request size ---------------------------------------------------------------------------------


def test_a_50_mb_body_gets_413_at_once_and_health_keeps_answering(server):
    """The declared length is refused before one byte of the body is read; /health stays fast."""
    size = 50 * 1000 * 1000
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        start = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {size}\r\n\r\n".encode() + b'{"model": "' + b"x" * 65536)
        health_s = _health_seconds(server.url)  # while the upload is open
        status, body = _read_response(sock, timeout_s=5)
        elapsed = time.perf_counter() - start
    assert status == 413 and elapsed < 1.0 and health_s < 1.0
    message = body["error"]["message"]
    assert str(size) in message and str(DEFAULT_MAX_REQUEST_BYTES) in message and "--max-request-bytes" in message
    assert _health_seconds(server.url) < 1.0


def test_a_chunked_body_is_counted_as_it_arrives(chat_target):
    """Without a Content-Length the server counts bytes and stops reading past the limit."""
    limit = 64 * 1024
    with start_server(chat_target, "none", num_pages=64, max_request_bytes=limit) as srv, \
            socket.create_connection((srv.host, srv.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"pad": "' + b"y" * (16 * 1024)
        sent = 0
        for _ in range(64):  # at most 1 MiB; the answer comes after about 64 KiB
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
            if select.select([sock], [], [], 0.2)[0]:
                break
        status, body = _read_response(sock, timeout_s=5)
        assert status == 413 and str(limit) in body["error"]["message"]
        assert limit < sent <= limit + 4 * len(chunk), f"the server read {sent} bytes before refusing"
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_body_under_the_limit_is_served(chat_target):
    with start_server(chat_target, "none", num_pages=64, max_request_bytes=300) as srv:
        ok = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        big = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "h" * 400, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert big.status_code == 413 and "300 bytes" in big.json()["error"]["message"]


class _SlowTokenizer(ChatByteTokenizer):
    """Tokenises in `delay_s`: stands in for a large prompt through a real tokenizer."""

    delay_s = 1.5

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        time.sleep(self.delay_s)
        return super().encode_prompt(prompt, raw)


def test_tokenising_runs_off_the_event_loop(chat_target):
    """While one request tokenises for 1.5 s, /health answers at once."""
    tokenizer = _SlowTokenizer(chat_target.config.vocab_size)
    with start_server(chat_target, "none", num_pages=64, tokenizer=tokenizer) as srv:
        result: dict = {}

        def post() -> None:
            result["response"] = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                                            json={"model": MODEL, "prompt": "slow", "max_tokens": 2})

        poster = threading.Thread(target=post)
        poster.start()
        time.sleep(0.3)  # the request is now inside encode_prompt
        health_s = _health_seconds(srv.url)
        poster.join(30)
    assert health_s < 0.5, f"/health took {health_s:.2f} s while a prompt was tokenised"
    assert result["response"].status_code == 200


# ---- errors in OpenAI's envelope ------------------------------------------------------------------


def test_a_body_that_is_not_utf8_gets_400_in_the_envelope(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny-llama", "prompt": "\xff\xfe"}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "UTF-8" in error["message"] and error["type"] == "invalid_request_error"
    lone = httpx.post(f"{server.url}/v1/completions", headers={"content-type": "application/json"},
                      content=b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 2}')
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"]
    paired = httpx.post(f"{server.url}/v1/completions", headers={"content-type": "application/json"},
                        content=b'{"model": "tiny-llama", "prompt": "a\\ud83d\\ude00b", "max_tokens": 2}')
    assert paired.status_code == 200


def test_seed_and_top_k_out_of_range_get_400_naming_the_range(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=2**70)
    assert "seed" in info.value.message and "2**64 - 1" in info.value.message and str(2**70) in info.value.message
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"top_k": 2**70})
    negative = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=-5, temperature=0.7)
    assert negative.usage.completion_tokens == 2  # in range: served
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_unknown_paths_and_methods_get_the_envelope(server):
    missing = httpx.get(f"{server.url}/v1/nothing-here")
    assert missing.status_code == 404 and "/v1/nothing-here" in missing.json()["error"]["message"]
    wrong = httpx.get(f"{server.url}/v1/completions")
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
    not_object = httpx.post(f"{server.url}/v1/completions", json=[1, 2])
    assert not_object.status_code == 400 and "invalid request" in not_object.json()["error"]["message"]


# ---- max_tokens near the limits -------------------------------------------------------------------


def test_without_max_tokens_a_long_prompt_is_clamped_to_the_room_left(server, client):
    prompt = "p" * 480  # 481 tokens with BOS: 512 - 481 - (K + 1) = 26 positions left
    room = CONTEXT - (len(prompt) + 1) - (K + 1)
    chat_prompt_tokens = len(ChatByteTokenizer(96).encode_chat([{"role": "user", "content": prompt}]))
    done = client.completions.create(model=MODEL, prompt=prompt)  # default 16 fits: not clamped
    assert done.usage.completion_tokens == 16
    longer = "p" * 495  # room 11 < 16
    done = client.completions.create(model=MODEL, prompt=longer)
    assert done.usage.completion_tokens == CONTEXT - (len(longer) + 1) - (K + 1)
    assert done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}])
    assert chat.usage.completion_tokens == CONTEXT - chat_prompt_tokens - (K + 1)  # 256 clamped
    # an explicit max_tokens that does not fit is still refused, naming the context
    with pytest.raises(openai.BadRequestError, match="context of 512"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=room + 1)
    with pytest.raises(openai.BadRequestError, match="context of 512"):
        client.completions.create(model=MODEL, prompt="p" * 510)  # no room at all


def test_without_max_tokens_the_pool_bounds_the_output_too(chat_target):
    """8 pages of 8 = 64 positions: a chat's default 256 tokens is clamped to what the pool holds."""
    with start_server(chat_target, "none", num_pages=8) as small, \
            openai.OpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        messages = [{"role": "user", "content": "hello"}]
        prompt_tokens = len(ChatByteTokenizer(96).encode_chat(messages))
        chat = c.chat.completions.create(model=MODEL, messages=messages)
        drafted = httpx.get(f"{small.url}/v1/models").json()["data"][0]["K"]  # 0: plain decoding
        assert chat.usage.completion_tokens == 64 - prompt_tokens - (drafted + 1)
        with pytest.raises(openai.BadRequestError, match="pool's capacity"):
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=64)


# ---- clients that leave ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_server(tiny_dirs, tmp_path_factory):
    """A tiny target with an 8192-token context, one running request at a time: a request runs for
    seconds (8,000 tokens), long enough to leave it in the middle."""
    directory = build_tiny_checkpoint(tmp_path_factory.mktemp("long") / "llama", "llama", max_positions=8192)
    target = load_tiny(directory)
    tokenizer = ChatByteTokenizer(target.config.vocab_size, eos=target.config.vocab_size)
    from hspec.drafters import create_drafter

    engine = build_engine(target.model, create_drafter("none", target.config), tokenizer, K, num_pages=1100,
                          page_size=8, max_running=1)
    with ServerThread(create_app(engine_worker(engine, MODEL), tokenizer, MODEL)) as srv:
        srv.engine = engine
        yield srv


def _wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` holds; fails after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_clients_that_leave_free_their_slot_and_kv_within_seconds(long_server):
    """A non-streaming request runs; a streaming one waits behind it (max_running=1). Both clients
    leave: each request is cancelled and the pool is empty again within 5 s."""
    url, engine = long_server.url, long_server.engine
    cancelled = _metric(url, 'hspec_requests_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 8000, "temperature": 0}

    outcomes: list[str] = []

    def leave_after(seconds: float, stream: bool) -> None:
        """Send the request, give up after `seconds` without an answer and close the connection."""
        try:
            with httpx.Client(timeout=seconds) as c:
                c.post(f"{url}/v1/completions", json=body | {"stream": stream})
            outcomes.append("answered")
        except httpx.ReadTimeout:
            outcomes.append("left")

    runner = threading.Thread(target=leave_after, args=(4.0, False))
    runner.start()
    _wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 1, 10, "the first request starting")
    leave_after(1.0, True)  # queued behind it the whole time: gets no token, leaves
    _wait_until(lambda: httpx.get(f"{url}/health").json()["waiting"] == 0, 5, "the queued request's cancel")
    assert httpx.get(f"{url}/health").json()["running"] == 1  # the other one is untouched
    runner.join(10)
    assert outcomes == ["left", "left"]
    left = time.monotonic()
    _wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 0, 5, "the running request's cancel")
    assert time.monotonic() - left < 5
    assert _metric(url, 'hspec_requests_finished_total{reason="cancelled"}') == cancelled + 2
    assert _metric(url, 'hspec_requests_finished_total{reason="length"}') == 0  # neither ran to the end
    _wait_until(lambda: engine.pool.num_free_pages == engine.pool.num_pages, 5, "the KV pages being freed")
