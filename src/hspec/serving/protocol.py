"""The OpenAI-compatible request bodies (pydantic) and response builders, with no server logic.

Validation happens here, so a bad body becomes a 400 with a message naming the field. Fields the
server does not implement are refused when set to anything but their neutral value (`n`, `logprobs`,
`echo`, penalties), rather than silently ignored; unknown extra fields are ignored, as OpenAI does.
`top_k` is an extension (vLLM's name; -1 or 0 = off); a temperature below 1e-5 is greedy. `max_tokens`
left out means "the server's default, clamped to the room the prompt leaves"; given, it must fit or the
request gets a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from hspec.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 128  # characters per stop string: bounds the tail a step searches (decoding/step.py)
GREEDY_BELOW = 1e-5  # a smaller temperature is greedy, as in vLLM (dividing by 1e-40 overflows to NaN)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_TOP_K = 2**63 - 1  # any k >= the vocabulary keeps every token; beyond this it overflows a long


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        low, high = SEED_RANGE
        if value is not None and not low <= value <= high:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_LENGTH:
            raise ValueError(f"stop strings must have at most {MAX_STOP_LENGTH} characters, got one of {len(longest)}")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; leave them 0")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> SamplingParams:
        temperature = self.temperature if self.temperature >= GREEDY_BELOW else 0.0
        return SamplingParams(temperature, self.top_p, max(self.top_k, 0))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a one-element list of strings."""

    prompt: str | list[int] | list[str]
    max_tokens: Annotated[int | None, Field(ge=1)] = None  # None: DEFAULT_MAX_TOKENS, clamped by the server
    echo: Literal[False] = False

    DEFAULT_MAX_TOKENS: ClassVar[int] = 16  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt is an empty list")
            if isinstance(value[0], str) and len(value) != 1:
                raise ValueError(f"batched prompts are not supported: send one prompt per request, got {len(value)}")
        elif not value:
            raise ValueError("prompt is empty")
        return value


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self

    def requested_max_tokens(self) -> int | None:
        """The output limit the client gave, or None (then the server's default applies)."""
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def openai_finish_reason(engine_reason: str | None) -> str | None:
    """Engine reasons -> OpenAI's: EOS and stop strings are both "stop"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(engine_reason or "", engine_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope; the `openai` client reads `error.message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None
                     ) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def chat_body(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
              prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(request_id: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None
               ) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
