"""The server when its engine fails, a request runs long, the queue is full, clients hold sockets or the
server is shut down: live on loopback, every wait bounded.

Faults are injected through a seam: scripts/hardening_server.py's `FaultyEngine` wraps the engine and the
worker handed to `create_app` runs it in its place. The scenarios are scripts/server_hardening.py's (its
results file reports them); each returns what it observed, asserted here.
"""

from __future__ import annotations

import pytest

from conftest import load_script

hardening = load_script("server_hardening")


@pytest.fixture(scope="module")
def target(byte_chat_target):
    return byte_chat_target


def test_a_step_failing_once_fails_its_request_with_a_generic_500_and_serving_goes_on(target):
    seen = hardening.fault_step_fails_once(target)
    assert seen["failed_request"] == 500 and not seen["leaked_internal_text"]
    assert seen["next_request"] == 200 and seen["health"] == 200


def test_steps_that_always_fail_mark_the_engine_broken_and_the_server_exits_1(target):
    """--max-failed-steps 3: a stream and a request fail (500), the third failed step marks the engine broken
    (503 from then on); /health's state is unhealthy and the server stops by itself with status 1."""
    seen = hardening.fault_step_always_fails(target, max_failed_steps=3)
    assert seen["stream_ended_with"] == [["error"], "[DONE]"]
    assert seen["statuses"][0] == 500 and set(seen["statuses"][1:]) <= {503, 0}  # 0: refused after the exit
    assert seen["all_answered_s"] < 10 and not seen["healthy"] and "3 steps in a row" in seen["reason"]
    assert seen["server_exited"] and seen["exit_code"] == 1
    assert seen["survived"]


def test_decoding_steps_failing_inside_the_engine_count_as_failed_steps(target):
    """A broken device fails every batch inside `Engine.step`, which returns normally: still loud."""
    seen = hardening.fault_decode_always_fails(target, max_failed_steps=3)
    assert seen["stream_ended_with"] == [["error"], "[DONE]"] and set(seen["statuses"][1:]) <= {503, 0}
    assert not seen["healthy"] and "3 steps in a row" in seen["reason"]
    assert seen["server_exited"] and seen["exit_code"] == 1


def test_an_error_inside_the_error_handling_kills_the_thread_loudly(target):
    """The step raises and abort_all raises too: the thread dies, yet every request is answered."""
    seen = hardening.fault_inside_error_handling(target)
    assert seen["stream_ended_with"] == [["error"], "[DONE]"] and set(seen["statuses"]) <= {503, 0}
    assert not seen["healthy"] and "thread died" in seen["reason"]
    assert seen["server_exited"] and seen["exit_code"] == 1


def test_a_request_past_its_deadline_fails_streamed_or_not_and_is_cancelled(target):
    seen = hardening.fault_request_deadline(target, timeout_s=0.5)
    assert seen["status"] == 504 and seen["answered_s"] < 1.5
    assert seen["stream_error_code"] == "timeout" and seen["stream_ended_with_done"] and seen["stream_s"] < 1.5
    assert seen["engine_freed"]


def test_shutdown_drains_then_ends_an_open_stream_with_an_error_and_done(target):
    """A short request finishes within the drain; a long stream gets an error event and [DONE] after it."""
    seen = hardening.fault_shutdown_drain(target, drain_s=1.0)
    assert seen["short_request"] == 200
    assert "drain" in seen["stream_error"] and seen["stream_ended_with_done"]
    assert seen["stream_ended_s"] < 4 and seen["exit_code"] == 0


def test_a_full_queue_answers_503_with_retry_after_at_once(target):
    seen = hardening.fault_queue_full(target)
    assert seen["status"] == 503 and seen["retry_after"] == "2" and seen["answered_s"] < 1


def test_connections_are_bounded_and_heads_or_bodies_that_never_end_are_closed(target):
    """--max-connections 4: three held (idle, a head cut short, a body cut short), a fourth and fifth beyond
    the bound get 503; after --header-timeout the trickled body gets 408 and all three are closed."""
    seen = hardening.fault_idle_connections(target, max_connections=4, header_timeout_s=0.5)
    assert seen["over_the_bound"] == "HTTP/1.1 503 Service Unavailable"
    assert seen["trickled_body"] == "HTTP/1.1 408 Request Timeout"
    assert seen["closed"] == 3 and seen["closed_after_s"] < 2.5 and seen["health_after"] == 200
