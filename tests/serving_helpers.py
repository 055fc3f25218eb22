"""What the server tests share: a tiny target's stand-in chat tokenizer and a live server on loopback."""

from __future__ import annotations

from conftest import _ByteTokenizer
from hspec.drafters import create_drafter
from hspec.serving.app import build_engine, create_app, engine_worker
from hspec.serving.server import ServerThread

MODEL = "tiny-llama"
K = 4


class ChatByteTokenizer(_ByteTokenizer):
    """The byte stand-in plus a minimal chat template and an injective decode.

    One character per token id, so equal texts mean equal tokens. `eos` may be an id outside the
    vocabulary: then the model never emits it and every request runs to its max_tokens.
    """

    def encode_chat(self, messages):
        return self.encode_prompt("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x100 + i) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))


def start_server(target, kind: str, num_pages: int, page_size: int = 8, tokenizer=None, **app_options
                 ) -> ServerThread:
    """A server of `target` with a `kind` drafter over a pool of `num_pages` (use it in `with`)."""
    tokenizer = tokenizer or target.tokenizer
    drafter = create_drafter(kind, target.config, target_model=target.model)
    engine = build_engine(target.model, drafter, tokenizer, K, num_pages=num_pages, page_size=page_size)
    return ServerThread(create_app(engine_worker(engine, MODEL, app_options.get("limits")), tokenizer, MODEL,
                                   **app_options))
