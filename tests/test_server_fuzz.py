"""Request bodies drawn at random from the API's schema, right and wrong (hypothesis): whatever comes, the
server answers in time and never with a 5xx. Live on loopback, 100 examples, a few seconds.

The routes read their bodies themselves (protocol.py validates them), so the schema is written here from
protocol.py's models: each field either of its own type and range, or any JSON value at all.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_helpers import MODEL

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=4)


def _field(good: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly one of its own kind, sometimes anything."""
    return st.one_of(good, good, ANY_JSON)


SAMPLING = {
    "max_tokens": _field(st.integers(-2, 6)),  # always given: the defaults (16, 256) would only cost time
    "temperature": _field(st.floats(-1, 3) | st.sampled_from([0.0, 1e-40, 2.0])),
    "top_p": _field(st.floats(-0.5, 1.5)),
    "top_k": _field(st.integers(-3, 200)),
    "seed": _field(st.integers(-(2**65), 2**65)),
    "stop": _field(st.text(max_size=4) | st.lists(st.text(max_size=140), max_size=6)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": _field(st.integers(0, 3)),
    "logprobs": _field(st.none() | st.integers(0, 3)),
    "presence_penalty": _field(st.floats(-1, 1)),
}
MESSAGE = st.fixed_dictionaries({"role": _field(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
                                 "content": _field(st.text(max_size=20) | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
                                     max_size=2))})
COMPLETION = st.fixed_dictionaries(
    {"model": _field(st.sampled_from([MODEL, "other"])), "max_tokens": SAMPLING["max_tokens"],
     "prompt": _field(st.text(max_size=30) | st.lists(st.integers(-5, 200), max_size=8)
                      | st.lists(st.text(max_size=8), max_size=2))},
    optional={k: v for k, v in SAMPLING.items() if k != "max_tokens"} | {"echo": _field(st.booleans())})
CHAT = st.fixed_dictionaries(
    {"model": _field(st.sampled_from([MODEL, "other"])), "max_tokens": SAMPLING["max_tokens"],
     "messages": _field(st.lists(MESSAGE, max_size=3))},
    optional={k: v for k, v in SAMPLING.items() if k != "max_tokens"} | {"max_completion_tokens": _field(
        st.integers(-1, 6))})


# What json.dumps cannot write but a client can send: integer literals past Python's 4,300-digit limit,
# nesting past the parser's recursion limit.
RAW_MEMBERS = st.one_of(
    st.integers(4000, 6000).map(lambda n: '"seed": ' + "9" * n),
    st.integers(500, 5000).map(lambda d: '"extra": ' + "[" * d + "]" * d),
    st.integers(500, 5000).map(lambda d: '"extra": ' + '{"a": ' * d + "1" + "}" * d))


def _with_raw_member(raw: str, member: str | None) -> str:
    return raw if member is None or not raw.startswith("{") else "{" + member + (", " if raw != "{}" else "") + raw[1:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10, headers={"content-type": "application/json"}) as client:
        yield client


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=st.one_of(COMPLETION.map(lambda b: ("/v1/completions", b)),
                         CHAT.map(lambda b: ("/v1/chat/completions", b))),
       member=st.none() | st.none() | st.none() | RAW_MEMBERS)
def test_no_body_gets_a_5xx_or_hangs(http, request, member):
    route, body = request
    raw = _with_raw_member(json.dumps(body, allow_nan=True), member)  # NaN and Infinity too: Python's json reads them
    response = http.post(route, content=raw)
    assert response.status_code < 500, (raw[:300], response.text)
    if response.status_code != 200:
        assert response.json()["error"]["message"]  # OpenAI's envelope
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
