"""The server under test of scripts/server_hardening.py: a tiny random Llama with a one-character-per-token
tokenizer, served on loopback through the real stack (uvicorn -> FastAPI -> the engine thread), n-gram
drafts, K=4; the fault seams handed to `create_app` in the engine's place; the clients that talk to it.
"""

# No `from __future__ import annotations`: tests load this file with conftest.load_script, outside
# sys.modules, where dataclasses cannot resolve string annotations.
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from hspec.drafters import create_drafter
from hspec.serving.app import build_engine, create_app, engine_worker
from hspec.serving.limits import ServingLimits
from hspec.serving.server import ServerThread

MODEL = "tiny-llama"
K = 4
API_KEY = "hardening-key"
INJECTED = "injected fault: internal detail 0xdeadbeef"  # must never reach a client


class ByteChatTokenizer:
    """One token per character (ids 3.. by code point modulo the vocabulary), decoded injectively, with a
    minimal chat template: equal texts mean equal tokens. `eos` outside the vocabulary: never emitted."""

    def __init__(self, vocab_size: int, eos: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (vocab_size if eos is None else eos,)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        return [1] + [3 + ord(c) % (self.vocab_size - 3) for c in prompt]

    def encode_chat(self, messages) -> list[int]:
        return self.encode_prompt("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x100 + i) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))


def build_tiny_target(directory: Path):
    """A random tiny Llama saved to `directory` and loaded through hspec's loader, with ByteChatTokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hspec.models import loading

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, like a trained model's: no greedy ties
    model.save_pretrained(directory, safe_serialization=True)
    hf = loading.read_config(directory)
    built = loading.build_model(hf, loading.read_state_dict(directory), torch.float32, "cpu", True, True)
    return loading.Target("tiny-llama", directory, hf, built, ByteChatTokenizer(hf.vocab_size))


class FaultyEngine:
    """An engine with injected faults: `step` raises on the calls `fail_step(n)` names (n from 1) and
    sleeps `step_delay_s` first; with `fail_abort`, `abort_all` (the worker's error handling) raises too.
    Everything else is the wrapped engine's."""

    def __init__(self, engine, fail_step: Callable[[int], bool] = lambda n: False, fail_abort: bool = False,
                 step_delay_s: float = 0.0) -> None:
        self.engine, self.fail_step, self.fail_abort, self.step_delay_s = engine, fail_step, fail_abort, step_delay_s
        self.num_steps = 0

    def step(self):
        self.num_steps += 1
        time.sleep(self.step_delay_s)
        if self.fail_step(self.num_steps):
            raise RuntimeError(INJECTED)
        return self.engine.step()

    def abort_all(self, message: str):
        if self.fail_abort:
            raise RuntimeError(INJECTED + " (inside error handling)")
        return self.engine.abort_all(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class BrokenDecodeStages:
    """Decoding stages whose batched steps always raise (a broken device context): the engine catches
    that itself and fails the batch, so `Engine.step` never raises. Handed to `Engine` in place of its
    stages; prefill and the rest are the wrapped stages'."""

    def __init__(self, stages) -> None:
        self.stages = stages

    def step(self, *args: Any, **kwargs: Any):
        raise RuntimeError(INJECTED)

    step_plain = step_tree = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)


def start_server(target, limits: ServingLimits | None = None, wrap: Callable[[Any], Any] | None = None,
                 max_running: int = 16, num_pages: int = 512, kind: str = "ngram") -> ServerThread:
    """A loopback server of `target` (use it in `with`); `wrap` turns its engine into what the app's worker runs."""
    drafter = create_drafter(kind, target.config, target_model=target.model)
    engine = build_engine(target.model, drafter, target.tokenizer, K, num_pages=num_pages, page_size=8,
                          max_running=max_running)
    served = wrap(engine) if wrap is not None else engine
    server = ServerThread(create_app(engine_worker(served, MODEL, limits), target.tokenizer, MODEL, limits=limits))
    server.engine = engine
    return server


def completion(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None, **fields: Any
               ) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0} | fields
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s, headers=headers)


def stream_events(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None, **fields: Any
                  ) -> list[Any]:
    """The `data:` payloads of a streamed completion: dicts, then the string "[DONE]"."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True} | fields
    events: list[Any] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s, headers=headers) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
