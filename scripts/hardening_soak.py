"""The soak of scripts/server_hardening.py: client threads cycling through whole and streamed completions,
slow readers, cancels, clients that leave, hostile requests and chats; every good request's text is
compared with its answer alone, and the process's file descriptors and RSS are read before and after."""

# No `from __future__ import annotations`: tests load this file with conftest.load_script, outside
# sys.modules, where dataclasses cannot resolve string annotations.
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from hardening_hostile import hostile_inputs, send_raw
from hardening_server import MODEL, completion, wait_until

CLIENT_KINDS = ("whole", "stream", "slow-stream", "cancel", "leave", "bad", "chat")
SOAK_PROMPTS = ["hello world, hello world", "abcabcabcabc", "the quick brown fox", "zz top", "one two one two",
                "to be or not to be", "lorem ipsum dolor", "aaaa bbbb aaaa"]


@dataclass
class SoakReport:
    seconds: float
    clients: int
    served: int = 0  # good requests answered whole
    mismatches: int = 0  # ... whose text differed from the request's answer alone
    left: int = 0  # requests whose client went away mid-way (cancels, timeouts)
    refused: int = 0  # bad requests answered with the expected 4xx
    unexpected: list[str] = field(default_factory=list)  # anything else: 5xx, broken streams, exceptions
    by_kind: dict[str, int] = field(default_factory=dict)
    fds_before: int = 0
    fds_after: int = 0
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


def _cases() -> list[dict[str, Any]]:
    """Greedy requests of several lengths; every third with a stop string (filled in from its answer alone)."""
    return [{"prompt": f"{p} #{i}", "max_tokens": 4 + (i * 5) % 21} for i, p in enumerate(SOAK_PROMPTS * 2)]


def answers_alone(url: str, headers: dict[str, str], cases: list[dict[str, Any]]) -> list[str]:
    """Each case's text served alone (one request at a time); stop strings added to every third case."""
    texts = []
    for i, case in enumerate(cases):
        text = completion(url, headers=headers, **case).json()["choices"][0]["text"]
        if i % 3 == 2 and len(text) > 4:
            case["stop"] = [text[3:5]]
            text = completion(url, headers=headers, **case).json()["choices"][0]["text"]
        texts.append(text)
    return texts


def soak(url: str, seconds: float, clients: int = 6, api_key: str | None = None) -> SoakReport:
    """`clients` threads, each cycling through CLIENT_KINDS for `seconds`; then wait for descriptors to settle."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    host, port = url.removeprefix("http://").rsplit(":", 1)
    cases = _cases()
    expected = answers_alone(url, headers, cases)
    bad = [h for h in hostile_inputs() if 400 <= h.expected < 500 and h.declared_length is None]
    report = SoakReport(seconds, clients, fds_before=open_fds(), rss_before_mib=round(rss_mib(), 1))
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def count(kind: str, outcome: str, detail: str = "") -> None:
        with lock:
            report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
            if outcome == "served":
                report.served += 1
            elif outcome == "mismatch":
                report.served += 1
                report.mismatches += 1
            elif outcome == "left":
                report.left += 1
            elif outcome == "refused":
                report.refused += 1
            else:
                report.unexpected.append(f"{kind}: {detail}"[:300])

    def one(http: httpx.Client, kind: str, n: int) -> None:
        case, want = cases[n % len(cases)], expected[n % len(cases)]
        body = {"model": MODEL, "temperature": 0, **case}
        if kind == "bad":
            case_bad = bad[n % len(bad)]
            status = send_raw(host, int(port), case_bad.wire(api_key))
            count(kind, "refused" if status == case_bad.expected else "other", f"{case_bad.name}: {status}")
        elif kind == "whole":
            response = http.post("/v1/completions", json=body)
            if response.status_code != 200:
                count(kind, "other", f"{response.status_code} {response.text}")
            else:
                count(kind, "served" if response.json()["choices"][0]["text"] == want else "mismatch")
        elif kind == "chat":
            response = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": case["prompt"]}], "max_tokens": 3})
            count(kind, "served" if response.status_code == 200 else "other", response.text)
        elif kind in ("stream", "slow-stream", "cancel"):
            texts, done = [], False
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if kind == "cancel":
                        count(kind, "left")
                        return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        count(kind, "other", json.dumps(event))
                        return
                    texts.append(event["choices"][0]["text"])
                    if kind == "slow-stream":
                        time.sleep(0.03)
            if not done:
                count(kind, "other", "the stream ended without [DONE]")
            else:
                count(kind, "served" if "".join(texts) == want else "mismatch")
        else:  # leave: give up before the answer
            try:
                http.post("/v1/completions", json=body | {"max_tokens": 24}, timeout=0.02)
                count(kind, "served")  # answered that fast: fine too
            except httpx.TimeoutException:
                count(kind, "left")

    def client(i: int) -> None:
        n = i
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            while time.monotonic() < end:
                kind = CLIENT_KINDS[n % len(CLIENT_KINDS)]
                try:
                    one(http, kind, n)
                except Exception as err:  # noqa: BLE001 - any client-side failure is a finding
                    count(kind, "other", f"{type(err).__name__}: {err}")
                n += clients

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    wait_until(lambda: open_fds() <= report.fds_before, 10)  # closed sockets leave the server's side too
    report.fds_after, report.rss_after_mib = open_fds(), round(rss_mib(), 1)
    return report
