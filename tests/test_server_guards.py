"""Who may ask and what a request may be, live on loopback: API key, Host, Content-Type, the 400s a
careless client earns, generic 500s, tiny temperatures and default seeds.

The hostile inputs are scripts/hardening_hostile.py's (scripts/server_hardening.py's results file lists
them with their statuses).
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from conftest import load_script
from hspec.serving.limits import LOOPBACK_NAMES, ServingLimits, host_name, is_loopback

hardening = load_script("hardening_server")
hostile = load_script("hardening_hostile")


@pytest.fixture(scope="module")
def target(byte_chat_target):
    return byte_chat_target


def test_every_hostile_input_gets_the_status_it_must(target):
    """415 without application/json, 400 for a foreign Host, 401 without the key, 400 (not 500) for a
    5,000-digit integer, JSON nested 100,000 deep, NaN, too many or too long stop strings..."""
    rows = hostile.run_hostile(target)
    wrong = [r for r in rows if r["status"] != r["expected"]]
    assert not wrong, wrong
    assert max(r["seconds"] for r in rows) < 5


def test_a_keyed_server_answers_401_without_its_key_on_v1_only(target):
    with hardening.start_server(target) as srv:
        assert hardening.completion(srv.url).status_code == 200
    with hardening.start_server(target, ServingLimits(api_key="k1")) as srv:
        missing = hardening.completion(srv.url)
        assert missing.status_code == 401 and "--api-key" in missing.json()["error"]["message"]
        assert missing.headers["www-authenticate"] == "Bearer"
        assert hardening.completion(srv.url, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert hardening.completion(srv.url, headers={"Authorization": "bearer k1"}).status_code == 200
        assert hardening.completion(srv.url, headers={"Authorization": "Bearer k1x"}).status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401


def test_host_names_and_loopback():
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "LocalHost", "::1", "evil.example:1")] == \
        ["127.0.0.1", "::1", "localhost", "::1", "evil.example"]
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.2", "example.com", "::"))
    assert set(LOOPBACK_NAMES) == {"localhost", "127.0.0.1", "::1"}


def test_a_tiny_temperature_is_greedy(target):
    with hardening.start_server(target) as srv:
        greedy = hardening.completion(srv.url, max_tokens=16, temperature=0).json()["choices"][0]["text"]
        tiny = hardening.completion(srv.url, max_tokens=16, temperature=1e-40, seed=3)
        assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy


def test_a_request_without_a_seed_is_not_seeded_by_its_arrival_number(target):
    """On a fresh server the first unseeded request used to get seed 0: anyone could replay its answer."""
    body = {"prompt": "seed", "max_tokens": 24, "temperature": 1.0}
    with hardening.start_server(target) as srv:
        unseeded = [hardening.completion(srv.url, **body).json()["choices"][0]["text"] for _ in range(2)]
        seeded = [hardening.completion(srv.url, seed=s, **body).json()["choices"][0]["text"] for s in range(4)]
    assert not set(unseeded) & set(seeded)


class _TemplateRefuses(hardening.ByteChatTokenizer):
    def encode_chat(self, messages):
        from jinja2.exceptions import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")


def test_a_chat_template_that_refuses_the_messages_is_a_400(target):
    refusing = dataclasses.replace(target, tokenizer=_TemplateRefuses(target.config.vocab_size))
    with hardening.start_server(refusing) as srv:
        response = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "model": hardening.MODEL, "max_tokens": 2, "messages": [{"role": "assistant", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "roles must alternate" in error["message"] and error["param"] == "messages"


class _ValidateBreaks(hardening.FaultyEngine):
    def validate(self, request):
        raise RuntimeError(hardening.INJECTED)


def test_an_unexpected_error_is_a_500_that_tells_nothing_of_the_internals(target):
    with hardening.start_server(target, wrap=_ValidateBreaks) as srv:
        response = hardening.completion(srv.url)
        health = httpx.get(f"{srv.url}/health")
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert "0xdeadbeef" not in response.text and "RuntimeError" not in response.text
    assert health.status_code == 200
