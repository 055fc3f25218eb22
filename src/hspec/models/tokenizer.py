"""The target's tokenizer and chat template, read from the same directory as its weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hspec.models.config import TargetConfig


class ChatTokenizer:
    """Encodes prompts (through the chat template unless raw) and decodes token ids."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_directory(cls, directory: Path, config: TargetConfig) -> ChatTokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory))
        eos = set(config.eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        return cls(hf, sorted(eos))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a conversation ending with the assistant's turn opened."""
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template; pass raw text instead")
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.hf.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """A single user turn through the chat template, or the raw text when `raw` (or no template)."""
        if raw or not self.has_chat_template:
            return self.hf.encode(prompt, add_special_tokens=True)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
