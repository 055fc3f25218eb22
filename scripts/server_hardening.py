"""The server on a bad day, live on loopback: hostile inputs, injected engine faults, a soak of mixed
clients. Writes results/server_hardening/{README.md,server_hardening.json}.

    python scripts/server_hardening.py                    # a 10-minute soak
    python scripts/server_hardening.py --soak-seconds 60  # CI's length

Serves a tiny random Llama built here (4 layers, hidden 64, vocabulary 96, 512 positions; no download)
with a one-character-per-token stand-in tokenizer, through the real stack: uvicorn (HspecServer) ->
FastAPI -> the engine thread, n-gram drafts, K=4. The figures are about the server, not the model.

Faults are injected through a seam, not by patching: `FaultyEngine` wraps an engine, and the worker
handed to `create_app` runs it in the engine's place. This file holds the injected faults and the results
file; the server under test and its clients are scripts/hardening_server.py, the hostile inputs
hardening_hostile.py, the soak hardening_soak.py. tests/test_server_faults.py, test_server_guards.py and
test_server_soak.py run these same pieces (imported with conftest.load_script), shorter.
"""

# No `from __future__ import annotations`: tests load this file with conftest.load_script, outside
# sys.modules, where dataclasses cannot resolve string annotations.
import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch
from hardening_hostile import run_hostile
from hardening_server import (
    API_KEY,
    INJECTED,
    BrokenDecodeStages,
    FaultyEngine,
    build_tiny_target,
    completion,
    start_server,
    stream_events,
    wait_until,
)
from hardening_soak import SoakReport, soak

from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits
from hspec.serving.server import ServerThread

# ---- injected faults -------------------------------------------------------------------------------


def fault_step_fails_once(target) -> dict[str, Any]:
    """The first engine step raises: its request fails with a generic 500, the next ones are served."""
    with start_server(target, wrap=lambda e: FaultyEngine(e, fail_step=lambda n: n == 1)) as srv:
        failed = completion(srv.url)
        served = completion(srv.url)
        health = httpx.get(f"{srv.url}/health")
    return {"fault": "the engine step raises once", "failed_request": failed.status_code,
            "leaked_internal_text": INJECTED in failed.text or "RuntimeError" in failed.text,
            "next_request": served.status_code, "health": health.status_code,
            "survived": failed.status_code == 500 and served.status_code == 200 and health.status_code == 200}


def _status(url: str) -> int:
    """A completion's status; 0 when the connection is refused (the server has exited)."""
    try:
        return completion(url, timeout_s=20).status_code
    except httpx.ConnectError:
        return 0


def _answers_and_exit(srv: ServerThread, requests: int) -> dict[str, Any]:
    """Send `requests` requests one after another (a streamed one first); see that each is answered, the
    engine reports itself broken and the server exits by itself with status 1."""
    start = time.monotonic()
    events = stream_events(srv.url, timeout_s=20)
    statuses = [_status(srv.url) for _ in range(requests - 1)]
    answered_s = time.monotonic() - start
    exited = srv.wait(20)
    return {"stream_ended_with": [e if isinstance(e, str) else sorted(e) for e in events[-2:]],
            "statuses": statuses, "all_answered_s": round(answered_s, 2), "healthy": srv.server.worker.healthy,
            "reason": srv.server.worker.refusal, "server_exited": exited, "exit_code": srv.server.exit_code}


def fault_step_always_fails(target, max_failed_steps: int = 3) -> dict[str, Any]:
    """Every step raises (a broken device): after `max_failed_steps` the server refuses, reports, exits 1.

    Statuses: 500 for a request failed by a step, 503 once the engine is marked broken, 0 (connection
    refused) once the server has exited.
    """
    limits = ServingLimits(max_failed_steps=max_failed_steps)
    with start_server(target, limits, wrap=lambda e: FaultyEngine(e, fail_step=lambda n: True)) as srv:
        seen = _answers_and_exit(srv, requests=max_failed_steps + 2)
    broken = seen["statuses"][max_failed_steps - 2:]  # the request of the last failed step, and after
    ok = (seen["stream_ended_with"] == [["error"], "[DONE]"] and seen["statuses"][:max_failed_steps - 2] == [500]
          * (max_failed_steps - 2) and set(broken) <= {503, 0} and not seen["healthy"] and seen["exit_code"] == 1)
    return {"fault": f"every engine step raises (--max-failed-steps {max_failed_steps})", **seen, "survived": ok}


def fault_decode_always_fails(target, max_failed_steps: int = 3) -> dict[str, Any]:
    """Every batched decoding step fails inside the engine (caught there: `Engine.step` returns, its
    requests failed): such steps count as failed too, and the server exits 1 after `max_failed_steps`."""
    from hspec.serving.engine import Engine

    limits = ServingLimits(max_failed_steps=max_failed_steps)
    wrap = lambda e: Engine(BrokenDecodeStages(e.stages), e.pool, e.max_running)  # noqa: E731
    with start_server(target, limits, wrap=wrap) as srv:
        seen = _answers_and_exit(srv, requests=max_failed_steps + 2)
    broken = seen["statuses"][max_failed_steps - 2:]
    ok = (seen["stream_ended_with"] == [["error"], "[DONE]"] and set(broken) <= {503, 0}
          and not seen["healthy"] and seen["exit_code"] == 1)
    return {"fault": f"every batched decoding step fails inside the engine (--max-failed-steps {max_failed_steps})",
            **seen, "survived": ok}


def fault_inside_error_handling(target) -> dict[str, Any]:
    """The step raises and so does the error handling (abort_all): the thread dies, loudly."""
    with start_server(target, wrap=lambda e: FaultyEngine(e, fail_step=lambda n: True, fail_abort=True)) as srv:
        seen = _answers_and_exit(srv, requests=3)
    ok = (seen["stream_ended_with"] == [["error"], "[DONE]"] and set(seen["statuses"]) <= {503, 0}
          and not seen["healthy"] and seen["exit_code"] == 1)
    return {"fault": "the step raises and the error handling raises too (the engine thread dies)", **seen,
            "survived": ok}


def fault_request_deadline(target, timeout_s: float = 0.5) -> dict[str, Any]:
    """A slow engine (50 ms a step) and a 200-token request: it fails at its deadline, streamed or not."""
    limits = ServingLimits(request_timeout_s=timeout_s)
    with start_server(target, limits, wrap=lambda e: FaultyEngine(e, step_delay_s=0.05)) as srv:
        start = time.monotonic()
        whole = completion(srv.url, max_tokens=200)
        whole_s = time.monotonic() - start
        start = time.monotonic()
        events = stream_events(srv.url, max_tokens=200)
        stream_s = time.monotonic() - start
        freed = wait_until(lambda: srv.engine.num_running == 0 and srv.engine.num_waiting == 0, 5)
    error = next((e["error"] for e in events if isinstance(e, dict) and "error" in e), {})
    ok = (whole.status_code == 504 and whole_s < timeout_s + 1 and error.get("code") == "timeout"
          and events[-1] == "[DONE]" and stream_s < timeout_s + 1 and freed)
    return {"fault": f"a request runs past --request-timeout {timeout_s:g}", "status": whole.status_code,
            "answered_s": round(whole_s, 2), "stream_error_code": error.get("code"), "stream_s": round(stream_s, 2),
            "stream_ended_with_done": events[-1] == "[DONE]", "engine_freed": freed, "survived": ok}


def fault_shutdown_drain(target, drain_s: float = 1.0) -> dict[str, Any]:
    """SIGTERM's path (should_exit) with a stream that outlives the drain and a request that fits in it."""
    limits = ServingLimits(drain_timeout_s=drain_s)
    with start_server(target, limits, wrap=lambda e: FaultyEngine(e, step_delay_s=0.02)) as srv:
        events: list[Any] = []
        short: dict[str, int] = {}
        streamer = threading.Thread(target=lambda: events.extend(stream_events(srv.url, max_tokens=400)))
        streamer.start()
        wait_until(lambda: srv.engine.num_running == 1, 10)
        shorter = threading.Thread(target=lambda: short.update(status=completion(srv.url, max_tokens=8).status_code))
        shorter.start()
        wait_until(lambda: srv.engine.num_running == 2, 10)
        start = time.monotonic()
        srv.server.should_exit = True  # what uvicorn's SIGTERM handler sets
        streamer.join(drain_s + 10)
        shorter.join(drain_s + 10)
        ended_s = time.monotonic() - start
        exited = srv.wait(10)
    error = next((e["error"] for e in events if isinstance(e, dict) and "error" in e), {})
    ok = ("drain" in error.get("message", "") and events[-1] == "[DONE]" and short.get("status") == 200
          and ended_s < drain_s + 3 and exited and srv.server.exit_code == 0)
    return {"fault": f"shutdown with a stream longer than --drain-timeout {drain_s:g}",
            "stream_error": error.get("message"), "stream_ended_with_done": bool(events) and events[-1] == "[DONE]",
            "short_request": short.get("status"), "stream_ended_s": round(ended_s, 2),
            "exit_code": srv.server.exit_code, "survived": ok}


def fault_idle_connections(target, max_connections: int = 4, header_timeout_s: float = 0.5) -> dict[str, Any]:
    """Slow clients holding sockets: the connection bound answers 503, the head deadline closes them."""
    limits = ServingLimits(max_connections=max_connections, header_timeout_s=header_timeout_s)
    with start_server(target, limits) as srv:
        idle = [socket.create_connection((srv.host, srv.port), timeout=5) for _ in range(max_connections - 1)]
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHo")  # a head that never ends (slowloris)
        wait_until(lambda: len(srv.server.server_state.connections) == max_connections - 1, 5)
        trickle = idle[1]  # a head, then a body that never arrives whole
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")
        over = [socket.create_connection((srv.host, srv.port), timeout=5) for _ in range(2)]
        over_answer = over[-1].recv(64)
        start = time.monotonic()
        trickle_answer = trickle.recv(64)
        closed = sum(_read_to_close(sock) for sock in idle)  # each blocks until the server closes it
        closed_s = time.monotonic() - start
        for sock in idle + over:
            sock.close()
        health = httpx.get(f"{srv.url}/health").status_code
    ok = (over_answer.startswith(b"HTTP/1.1 503") and trickle_answer.startswith(b"HTTP/1.1 408")
          and closed == len(idle) and closed_s < header_timeout_s + 2)
    return {"fault": f"{max_connections + 1} connections: idle, a head that never ends, a body that never ends "
                     f"(--max-connections {max_connections}, --header-timeout {header_timeout_s:g})",
            "over_the_bound": over_answer.split(b"\r\n")[0].decode(),
            "trickled_body": trickle_answer.split(b"\r\n")[0].decode(), "closed": closed,
            "closed_after_s": round(closed_s, 2), "health_after": health, "survived": ok and health == 200}


def _read_to_close(sock: socket.socket) -> bool:
    """Read until the server closes `sock` (True), or the socket's timeout passes (False)."""
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def fault_queue_full(target) -> dict[str, Any]:
    """One running, one waiting (--max-waiting 1): the third request gets 503 with Retry-After at once."""
    limits = ServingLimits(max_waiting=1, retry_after_s=2)
    with start_server(target, limits, wrap=lambda e: FaultyEngine(e, step_delay_s=0.02), max_running=1) as srv:
        holders = [threading.Thread(target=completion, args=(srv.url, 5.0), kwargs={"max_tokens": 150})
                   for _ in range(2)]
        for holder in holders:
            holder.start()
            time.sleep(0.1)
        wait_until(lambda: srv.engine.num_running == 1 and srv.engine.num_waiting == 1, 10)
        start = time.monotonic()
        refused = completion(srv.url)
        refused_s = time.monotonic() - start
        for holder in holders:
            holder.join(10)
    ok = refused.status_code == 503 and refused.headers.get("retry-after") == "2" and refused_s < 1
    return {"fault": "a request beyond --max-waiting 1", "status": refused.status_code,
            "retry_after": refused.headers.get("retry-after"), "answered_s": round(refused_s, 3), "survived": ok}


FAULTS = (fault_step_fails_once, fault_step_always_fails, fault_decode_always_fails, fault_inside_error_handling,
          fault_request_deadline, fault_shutdown_drain, fault_idle_connections, fault_queue_full)


# ---- the results file ------------------------------------------------------------------------------


def write_results(out: Path, hostile: list[dict[str, Any]], faults: list[dict[str, Any]], report: SoakReport,
                  command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "model": "tiny random Llama (4 layers, hidden 64, vocab 96), n-gram drafts, K=4",
            "hostile_inputs": hostile, "faults": faults, "soak": asdict(report)}
    (out / "server_hardening.json").write_text(json.dumps(data, indent=1) + "\n")
    as_expected = sum(r["status"] == r["expected"] for r in hostile)
    lines = [
        "# The server on a bad day", "",
        f"Made by `{command}` (scripts/server_hardening.py; without --soak-seconds it soaks for ten minutes) on "
        f"a {os.cpu_count()}-core CPU machine, against a live loopback server of a "
        "tiny random Llama (4 layers, hidden 64, vocabulary 96; a one-character-per-token tokenizer), n-gram "
        "drafts, K=4: the figures are about the HTTP server and the engine thread, not the model. "
        "Raw numbers: server_hardening.json.", "",
        f"## Hostile inputs: {as_expected} of {len(hostile)} got the status they must", "",
        "Sent as raw bytes to a server bound to 127.0.0.1 with an API key (each with the right key and "
        "`Host: 127.0.0.1` unless the row says otherwise).", "",
        "| input | must get | got | seconds |", "|---|---|---|---|",
        *(f"| {r['input']} | {r['expected']} | {r['status']} | {r['seconds']} |" for r in hostile), "",
        f"## Injected faults: {sum(f['survived'] for f in faults)} of {len(faults)} survived as they must", "",
        "Injected through `FaultyEngine`, which the worker handed to `create_app` runs in place of the engine.", "",
        "Statuses: 500 for a request a failed step took down, 503 once the engine is marked broken, 0 when the "
        "connection is refused because the server has already exited.", "",
        "| fault | what happened | survived |", "|---|---|---|",
        *(f"| {f['fault']} | {_observed(f)} | {'yes' if f['survived'] else '**no**'} |" for f in faults), "",
        f"## Soak: {report.seconds:g} s, {report.clients} clients", "",
        "Each client cycles through whole and streamed completions (every third with a stop string), slow "
        "readers, clients that cancel a stream after its first event or leave a request before its answer, "
        "hostile requests and chats; every good request's text is compared with its answer alone.", "",
        "| figure | value |", "|---|---|",
        f"| good requests served whole | {report.served} |",
        f"| ... whose output differed from the request alone | {report.mismatches} |",
        f"| requests left mid-way by their client | {report.left} |",
        f"| hostile requests refused with the right 4xx | {report.refused} |",
        f"| anything else (5xx, broken streams, client errors) | {len(report.unexpected)} |",
        f"| open file descriptors before / after | {report.fds_before} / {report.fds_after} "
        f"(drift {report.fds_after - report.fds_before:+d}) |",
        f"| RSS before / after (MiB) | {report.rss_before_mib} / {report.rss_after_mib} "
        f"(drift {report.rss_after_mib - report.rss_before_mib:+.1f}; the soak test's bound: 64) |",
        f"| requests by client kind | {', '.join(f'{k} {v}' for k, v in sorted(report.by_kind.items()))} |", "",
        *([f"Unexpected: {', '.join(report.unexpected[:10])}", ""] if report.unexpected else []),
    ]
    (out / "README.md").write_text("\n".join(lines))


def _observed(fault: dict[str, Any]) -> str:
    return "; ".join(f"{k} {v}" for k, v in fault.items() if k not in ("fault", "survived"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak-seconds", type=float, default=600.0, help="length of the soak (default 600)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent soak clients (default 6)")
    parser.add_argument("--out", default="results/server_hardening", help="output folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        target = build_tiny_target(Path(tmp) / "tiny-llama")
        hostile = run_hostile(target)
        faults = [fault(target) for fault in FAULTS]
        with start_server(target, ServingLimits(api_key=API_KEY, allowed_hosts=LOOPBACK_NAMES)) as srv:
            report = soak(srv.url, args.soak_seconds, args.clients, API_KEY)
    command = "python scripts/server_hardening.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    write_results(Path(args.out), hostile, faults, report, command)
    bad = [r for r in hostile if r["status"] != r["expected"]] + [f for f in faults if not f["survived"]]
    print(f"wrote {args.out}/README.md: {len(bad)} failures, {report.mismatches} mismatches, "
          f"{len(report.unexpected)} unexpected")
    return 1 if bad or report.mismatches or report.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
