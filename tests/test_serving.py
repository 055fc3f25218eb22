"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client.

A tiny random target serves through the real stack (uvicorn thread -> FastAPI -> engine thread):
conftest's `chat_target`, `server` and `client`.
Its stand-in tokenizer decodes injectively (one character per token id), so equal texts mean equal
tokens.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from hspec.decoding.text import TextStream
from serving_helpers import MODEL, start_server

PROMPTS = ["hello world, hello world", "abcabcabcabc", "the quick brown fox", "zz top", "one two one two one",
           "to be or not to be", "lorem ipsum dolor sit amet", "aaaa bbbb aaaa bbbb"]


def _metric(url: str, name: str, default: float | None = None) -> float:
    """One sample of /metrics; `default` when absent (a labelled series appears on first use)."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if match is None and default is not None:
        return default
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("hspec_http_requests_total", "hspec_generation_tokens_total", "hspec_kv_cache_usage_fraction",
                 "hspec_num_requests_waiting", "hspec_mean_accepted_length", "hspec_spec_decode_steps_total"):
        assert name in text


def test_completion_chat_and_streaming(server, client):
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    choice = done.choices[0]
    assert done.usage.completion_tokens == len(choice.text) and choice.finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True))
    assert streamed == choice.text

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=20, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    # the engine's acceptance counters moved: ngram drafts were verified
    assert _metric(server.url, "hspec_spec_decode_steps_total") > 0


def test_stop_string_is_cut_from_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


def _request_args(i: int) -> dict:
    """32 distinct requests: greedy, with a few seeded sampled ones mixed in."""
    args = dict(model=MODEL, prompt=f"{PROMPTS[i % len(PROMPTS)]} #{i}", max_tokens=8 + (i * 7) % 25)
    return args | (dict(temperature=0.8, top_p=0.9, seed=i) if i % 8 == 7 else dict(temperature=0))


def _texts_concurrently(url: str, requests: list[dict]) -> list[str]:
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            done = await asyncio.gather(*(c.completions.create(**r) for r in requests))
        return [d.choices[0].text for d in done]

    return asyncio.run(run())


def test_32_concurrent_requests_equal_each_alone(server, client):
    requests = [_request_args(i) for i in range(32)]
    alone = [client.completions.create(**r).choices[0].text for r in requests]
    rows, steps = _metric(server.url, "hspec_spec_decode_steps_total"), _metric(server.url, "hspec_engine_steps_total")
    assert _texts_concurrently(server.url, requests) == alone
    rows = _metric(server.url, "hspec_spec_decode_steps_total") - rows
    steps = _metric(server.url, "hspec_engine_steps_total") - steps
    assert rows / steps > 4, "the concurrent requests were not batched together"


def test_full_pool_queues_or_preempts_instead_of_failing(chat_target):
    """24 pages of 8 hold about two of these requests at full length; eight arrive at once."""
    requests = [dict(model=MODEL, prompt=p, max_tokens=90, temperature=0) for p in PROMPTS]
    with start_server(chat_target, "ngram", num_pages=24) as small:
        with openai.OpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            alone = [c.completions.create(**r).choices[0].text for r in requests]
        assert _texts_concurrently(small.url, requests) == alone
        assert _metric(small.url, "hspec_preemptions_total") > 0


def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(server, client):
    def status_and_message(**kwargs):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(**kwargs)
        return info.value.status_code, info.value.message

    status, message = status_and_message(model="no-such-model", prompt="hi")
    assert status == 404 and "no-such-model" in message
    status, message = status_and_message(model=MODEL, prompt="hi", max_tokens=-3)
    assert status == 400 and "max_tokens" in message
    status, message = status_and_message(model=MODEL, prompt="x" * 600, max_tokens=8)  # context is 512
    assert status == 400 and "context" in message
    status, message = status_and_message(model=MODEL, prompt="hi", temperature=-1)
    assert status == 400 and "temperature" in message
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)

    raw = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "tiny-llama", "messages": [',
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=4, temperature=0).choices[0].text


def test_oversize_for_the_pool_is_refused(chat_target):
    with start_server(chat_target, "none", num_pages=4) as small:  # 32 KV positions
        response = httpx.post(f"{small.url}/v1/completions",
                              json=dict(model=MODEL, prompt="a prompt of forty characters, give or take", max_tokens=4))
        assert response.status_code == 400 and "pool's capacity" in response.json()["error"]["message"]


def test_client_disconnect_cancels_the_request(server, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while _metric(server.url, 'hspec_requests_finished_total{reason="cancelled"}', 0) < 1 \
            or httpx.get(f"{server.url}/health").json()["running"]:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)


def test_text_stream_holds_back_a_possible_stop_prefix():
    decode = "".join  # token "ids" are characters here
    stream = TextStream(decode, stop=["xyz"])
    assert stream.push(["a", "b", "x"], finished=False) == "a"  # "bx" could start "xyz"
    assert stream.push(["y", "q"], finished=False) == "bx"
    assert stream.push(["x", "y", "z", "!"], finished=True) == "yq"


def test_cut_at_stop_cuts_before_the_earliest_stop_string():
    from hspec.decoding.text import cut_at_stop

    assert cut_at_stop("one. two! three.", ["!", "."]) == "one"  # the earliest match wins, not the first listed
    assert cut_at_stop("no stop here", ["xyz"]) == "no stop here"
    assert cut_at_stop("anything", []) == "anything"


def test_metrics_leave_early_stopped_steps_out_of_the_next_positions_denominator():
    from prometheus_client.parser import text_string_to_metric_families

    from hspec.serving.engine import StepReport
    from hspec.serving.metrics import ServingMetrics

    metrics = ServingMetrics("m", "hspec+ngram:0.4", K=7, kv_capacity_tokens=64)
    # row 0: 7 drafts, 2 accepted; row 1: stopped after 3 drafts, all accepted; row 2: 7 drafts, none accepted
    metrics.observe_step(StepReport([], 3, [2, 3, 0], [7, 3, 7], 7, 0, 8, 0, 3, 0, 0.5, 0.01))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    accepted = [samples[("hspec_spec_decode_accepted_tokens_total", str(k))] for k in range(1, 8)]
    verified = [samples[("hspec_spec_decode_verified_tokens_total", str(k))] for k in range(1, 8)]
    assert accepted == [2, 2, 1, 0, 0, 0, 0]
    assert verified == [3, 2, 2, 0, 0, 0, 0]  # row 1 verified no 4th draft: it is not a refusal at k = 4
    assert samples[("hspec_mean_accepted_length", None)] == pytest.approx(1 + 5 / 3)
    # a `:auto` step where row 1 drafted nothing (a plain decode step): only the drafting rows count
    metrics.observe_step(StepReport([], 2, [1, 0], [4, 0], 7, 0, 3, 0, 2, 0, 0.5, 0.01))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert samples[("hspec_spec_decode_steps_total", None)] == 4
    assert samples[("hspec_mean_accepted_length", None)] == pytest.approx(1 + 6 / 4)
