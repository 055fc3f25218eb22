"""Output text a step at a time: streaming detokenisation and stop-string search do bounded work per
step and give what the whole output's decode gives.

Two real tokenizers, trained here in a moment on a few sentences with `tokenizers` (no download):
byte-level BPE (GPT-2, Qwen, SmolLM2: a multi-byte character can span tokens, so a prefix decodes
to U+FFFD) and Metaspace BPE (Llama/SentencePiece: the decoder drops a leading space, so a token's
text depends on the one before).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspec.decoding.step import stop_prefix_length, stop_window
from hspec.decoding.text import TextStream, cut_at_stop

CORPUS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ça va? naïve café", "日本語のテキスト と 漢字",
          "emoji 🙂🚀 and 🎉 party", "stop here. STOP! end of text; the end"] * 20
ALPHABET = "abcdeéö fox the.!;,日本🙂🚀"


def _train(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                                        special_tokens=["<unk>"], show_progress=False))
    return tok


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request):
    return _train(request.param)


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(ids[i:i + size])
        i += size
    return out + ([ids[i:]] if i < len(ids) else [])


@settings(max_examples=60, deadline=None)
@given(text=st.text(ALPHABET, min_size=1, max_size=60), sizes=st.lists(st.integers(1, 8), max_size=30),
       stop=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2))
def test_streamed_text_is_the_whole_decode_cut_at_stop(tokenizer, text, sizes, stop):
    """As the server streams: the output ends at the token completing a stop string (the engine's cut)."""
    ids = tokenizer.encode(text).ids
    decode = tokenizer.decode
    if stop:
        ids = ids[:stop_prefix_length(ids, 0, stop, decode) or len(ids)]
    stream = TextStream(decode, stop)
    chunks = _chunks(ids, sizes) or [[]]
    streamed = "".join(stream.push(c, finished=i == len(chunks) - 1) for i, c in enumerate(chunks))
    assert streamed == cut_at_stop(decode(ids), stop)


def _stop_by_whole_decode(token_ids: list[int], checked: int, stop: list[str], decode) -> int | None:
    """The reference: the first n > checked whose whole decode holds a stop string."""
    for n in range(checked + 1, len(token_ids) + 1):
        if any(s in decode(token_ids[:n]) for s in stop):
            return n
    return None


@settings(max_examples=60, deadline=None)
@given(text=st.text(ALPHABET, min_size=1, max_size=80), step=st.integers(1, 8), at=st.floats(0, 1),
       length=st.integers(1, 4))
def test_the_tail_window_stops_at_the_token_the_whole_decode_stops_at(tokenizer, text, step, at, length):
    ids = tokenizer.encode(text).ids
    full = tokenizer.decode(ids)
    start = int(at * max(0, len(full) - length))
    stop = [full[start:start + length] or "x"]
    expected = _stop_by_whole_decode(ids, 0, stop, tokenizer.decode)
    got, checked = None, 0
    while got is None and checked < len(ids):  # emitted `step` tokens at a time, as a speculative step does
        end = min(len(ids), checked + step)
        got = stop_prefix_length(ids[:end], checked, stop, tokenizer.decode)
        checked = end
    assert got == expected


class _CountingDecode:
    """A decode that records how many tokens each call decoded."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, ids) -> str:
        self.sizes.append(len(ids))
        return "".join(chr(0x100 + i) for i in ids)


def test_streaming_decodes_a_bounded_tail_per_step_not_the_whole_output():
    decode = _CountingDecode()
    stream = TextStream(decode, stop=["xyz"])
    for i in range(3000):
        stream.push([i % 50, (i + 1) % 50], finished=False)
        if i == 10:
            decode.sizes.clear()
    assert max(decode.sizes) <= 4, f"a push decoded {max(decode.sizes)} tokens of a 6000-token output"


def test_stop_search_decodes_a_bounded_tail_per_step_not_the_whole_output():
    decode = _CountingDecode()
    ids: list[int] = []
    stop = ["never in this output"]  # code points >= 0x100 only
    for i in range(3000):
        new = [i % 50, (i + 3) % 50, (i + 7) % 50]
        checked = len(ids)
        ids.extend(new)
        assert stop_prefix_length(ids, checked, stop, decode) is None
    window = stop_window(stop)
    assert max(decode.sizes) <= window + 3, f"a step decoded {max(decode.sizes)} tokens of 9000"
