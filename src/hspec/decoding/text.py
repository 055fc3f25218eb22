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
    """Incremental detokenisation: text deltas that never need to be taken back, each push decoding
    only the tokens since the last settled text (not the whole output).

    The new tokens are decoded together with the tokens of the previous delta, and the text beyond
    that context's own is new (as vLLM's incremental detokenizer): a token whose text depends on the
    one before (a leading space) comes out as in the whole output. Text ending in an incomplete UTF-8
    character (U+FFFD) waits for the next token. With stop strings, the last len(longest stop) - 1
    characters are held back, as they could begin a stop string that the final text must not contain;
    at the end the held text is cut at the first stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._context = 0  # token_ids[_context:_settled] decode to context for the next tokens' text
        self._settled = 0  # tokens whose text is in sent text or `_pending`
        self._pending = ""  # settled text not sent yet (held back, at most `hold` characters between pushes)
        self._sent_tail = ""  # the last `hold` characters sent: a stop string may begin there

    def push(self, new_token_ids: Sequence[int], finished: bool) -> str:
        """Add tokens; return the text delta that is now safe to send."""
        self.token_ids.extend(new_token_ids)
        # 1. Settle the new tokens' text, unless it is incomplete or rewrites the context.
        context = self.decode(self.token_ids[self._context:self._settled])
        text = self.decode(self.token_ids[self._context:])
        complete = len(text) > len(context) and not text.endswith("\ufffd")
        if text.startswith(context) and (complete or finished):
            self._pending += text[len(context):]
            self._context, self._settled = self._settled, len(self.token_ids)
        # 2. Send what no stop string can claim.
        if finished:
            tail = self._sent_tail + self._pending
            kept = cut_at_stop(tail, self.stop)
            if len(kept) < len(self._sent_tail):  # a stop string in text already sent: it cannot be taken back
                return ""
            delta, self._pending = kept[len(self._sent_tail):], ""
        else:
            n = max(0, len(self._pending) - self.hold)
            delta, self._pending = self._pending[:n], self._pending[n:]
        sent = self._sent_tail + delta
        self._sent_tail = sent[max(0, len(sent) - self.hold):]
        return delta
