"""Output text from output tokens: cutting at stop strings, and incremental detokenisation for streaming.

Pure functions of a `decode` callable (token ids -> text); no model, no I/O. `hspec generate` and the
HTTP server both cut at stop strings with `cut_at_stop`, so a command-line answer and a served one
end at the same place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI leaves the stop string out)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


class TextStream:
    """Incremental detokenisation: text deltas that never need to be taken back.

    Decodes the whole output each time and sends what is new, holding back an incomplete UTF-8
    character (U+FFFD at the end) and, with stop strings, the last len(longest stop) - 1 characters,
    which could be the start of a stop string that the final text must not contain.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, new_token_ids: Sequence[int], finished: bool) -> str:
        """Add tokens; return the text delta that is now safe to send."""
        self.token_ids.extend(new_token_ids)
        text = self.decode(self.token_ids)
        if finished:
            text = cut_at_stop(text, self.stop)
        else:
            text = text.rstrip("\ufffd")
            text = text[: max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):  # a tokenizer that rewrote earlier text: wait for it to settle
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
