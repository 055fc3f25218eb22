"""Hostile inputs for scripts/server_hardening.py: what a careless or hostile client sends, as raw bytes,
with the status each must get from a loopback server that has an API key."""

# No `from __future__ import annotations`: tests load this file with conftest.load_script, outside
# sys.modules, where dataclasses cannot resolve string annotations.
import json
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx
from hardening_server import API_KEY, MODEL, start_server

from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits


@dataclass(frozen=True)
class Hostile:
    """One request sent as raw bytes, and the status it must get."""

    name: str
    expected: int
    body: bytes = b""
    path: str = "/v1/completions"
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()  # replace the defaults of the same name; "" drops one
    declared_length: int | None = None  # a Content-Length other than the body's (the body is never sent whole)

    def wire(self, api_key: str | None) -> bytes:
        headers = {"host": "127.0.0.1", "content-type": "application/json", "connection": "close",
                   "authorization": f"Bearer {api_key}" if api_key else ""}
        headers.update(dict(self.headers))
        if self.method == "POST":
            headers["content-length"] = str(self.declared_length or len(self.body))
        lines = [f"{self.method} {self.path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items() if v)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def _json(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0} | fields).encode()


def _json_raw(member: str) -> bytes:
    """A completion body with one member written by hand (what json.dumps cannot write)."""
    return (_json()[:-1].decode() + ", " + member + "}").encode()


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]} | fields
                      ).encode()


def hostile_inputs() -> list[Hostile]:
    """What a careless or hostile client sends; the server is bound to loopback and has an API key."""
    ok, chat = _json(), "/v1/chat/completions"
    deep = b'{"model": "tiny-llama", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        Hostile("a well-formed completion (control)", 200, ok),
        Hostile("a well-formed chat (control)", 200, _chat(), chat),
        Hostile("Content-Type text/plain (a web page's POST needing no preflight)", 415, ok,
                headers=(("content-type", "text/plain"),)),
        Hostile("no Content-Type", 415, ok, headers=(("content-type", ""),)),
        Hostile("Content-Type application/json; charset=utf-8", 200, ok,
                headers=(("content-type", "application/json; charset=utf-8"),)),
        Hostile("Host evil.example:8000 (DNS rebinding)", 400, ok, headers=(("host", "evil.example:8000"),)),
        Hostile("Host localhost:1234", 200, ok, headers=(("host", "localhost:1234"),)),
        Hostile("Host [::1]:8000", 200, ok, headers=(("host", "[::1]:8000"),)),
        Hostile("no API key", 401, ok, headers=(("authorization", ""),)),
        Hostile("a wrong API key", 401, ok, headers=(("authorization", "Bearer not-the-key"),)),
        Hostile("no API key on /health (open for probes)", 200, path="/health", method="GET",
                headers=(("authorization", ""),)),
        Hostile("a declared 50 MB body", 413, b'{"model": "', declared_length=50_000_000),
        Hostile("a body that is not UTF-8", 400, b'{"model": "tiny-llama", "prompt": "\xff\xfe"}'),
        Hostile("malformed JSON", 400, b'{"model": '),
        Hostile("a JSON array body", 400, b"[1, 2]"),
        Hostile("an integer of 5,000 digits", 400, _json_raw('"seed": ' + "9" * 5000)),
        Hostile("arrays nested 100,000 deep", 400, deep),
        Hostile("a lone UTF-16 surrogate", 400, _json_raw('"stop": "a\\ud800"')),
        Hostile("seed 2**70", 400, _json(seed=2**70)),
        Hostile("top_k 2**70", 400, _json(top_k=2**70)),
        Hostile("temperature NaN", 400, _json_raw('"temperature": NaN')),
        Hostile("temperature 3", 400, _json(temperature=3)),
        Hostile("temperature 1e-40 (greedy)", 200, _json(temperature=1e-40)),
        Hostile("5 stop strings", 400, _json(stop=list("abcde"))),
        Hostile("a stop string of 129 characters", 400, _json(stop=["s" * 129])),
        Hostile("max_tokens 10**9", 400, _json(max_tokens=10**9)),
        Hostile("max_tokens 0", 400, _json(max_tokens=0)),
        Hostile("n = 2", 400, _json(n=2)),
        Hostile("logprobs", 400, _json(logprobs=5)),
        Hostile("token ids outside the vocabulary", 400, _json(prompt=[1, 10**6])),
        Hostile("an empty prompt", 400, _json(prompt="")),
        Hostile("two prompts", 400, _json(prompt=["a", "b"])),
        Hostile("an unknown model", 404, _json(model="gpt-x")),
        Hostile("a chat without messages", 400, _chat(messages=[]), chat),
        Hostile("a chat message with role 'tool'", 400, _chat(messages=[{"role": "tool", "content": "x"}]), chat),
        Hostile("an image content part", 400, _chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]), chat),
        Hostile("an unknown path", 404, path="/v1/nothing", method="GET"),
        Hostile("GET on a POST route", 405, method="GET"),
    ]


def send_raw(host: str, port: int, data: bytes, timeout_s: float = 15.0) -> int:
    """Send `data` on a new connection; the answer's status (0: closed without one)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server answered and closed before reading it all (413)
            pass
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split()[1]) if head.startswith(b"HTTP/") else 0


def run_hostile(target) -> list[dict[str, Any]]:
    """Each hostile input against a loopback server with an API key: name, expected and got status, seconds."""
    limits = ServingLimits(api_key=API_KEY, allowed_hosts=LOOPBACK_NAMES)
    rows = []
    with start_server(target, limits) as srv:
        for case in hostile_inputs():
            start = time.perf_counter()
            status = send_raw(srv.host, srv.port, case.wire(API_KEY))
            rows.append({"input": case.name, "expected": case.expected, "status": status,
                         "seconds": round(time.perf_counter() - start, 3)})
        rows.append({"input": "/health after all of them", "expected": 200,
                     "status": httpx.get(f"{srv.url}/health").status_code, "seconds": 0.0})
    return rows
