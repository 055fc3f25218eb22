"""Model-free prompt-lookup drafting (Saxena, 2023).

Find the most recent earlier occurrence of the history's last n tokens (n from `max_ngram` down to
`min_ngram`) and propose the K tokens that followed it. Proposals are deterministic, so the draft
distribution is one-hot; stochastic verification then accepts d_k with probability p(d_k), which
keeps sampling exact. A row without a match drafts nothing: its step is a plain decode (the last token
repeated, what it would otherwise propose, is a guess the target rejects, and each verified guess costs a
verify row). Each row reports its match's length (`Proposal.match_length`), which `ngram:auto` keeps a record per.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hspec.drafters.base import DRAFTERS, DraftBatch, Drafter, Proposal
from hspec.models.config import TargetConfig


@DRAFTERS.register("ngram")
class NgramDrafter(Drafter):
    def __init__(self, config: TargetConfig, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.vocab_size = config.vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def free_rows(self, batch: DraftBatch) -> list[bool]:
        return [True] * len(batch.seq_ids)  # a lookup in the history, no model

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        device = batch.anchor_tokens.device
        matches = [longest_suffix_match(history, self.max_ngram) for history in batch.tokens]
        lengths = [m.length if m is not None and m.length >= self.min_ngram else 0 for m in matches]
        rows = [m.continuation(history, K) if length else [history[-1]] * K
                for m, length, history in zip(matches, lengths, batch.tokens)]
        tokens = torch.tensor(rows, dtype=torch.long, device=device)  # (B, K)
        num_drafts = None if all(lengths) else torch.tensor([K if length else 0 for length in lengths], device=device)
        # deterministic drafts: one-hot distributions (`Proposal.probs`)
        return Proposal(tokens, None, num_drafts, match_length=torch.tensor(lengths, device=device))


@dataclass(frozen=True)
class SuffixMatch:
    """The history's last `length` tokens also end at index `end` (< len(history) - 1)."""

    length: int
    end: int

    def continuation(self, history: Sequence[int], K: int) -> list[int]:
        """The K tokens after the match, padded with the history's last token."""
        follow = list(history[self.end + 1:self.end + 1 + K])
        return follow + [history[-1]] * (K - len(follow))


def longest_suffix_match(history: Sequence[int], max_ngram: int) -> SuffixMatch | None:
    """The most recent earlier occurrence of the longest suffix of `history` (at most `max_ngram`
    tokens) that leaves at least one token after it; None if even the last token never occurred.

    Equivalent to trying n = max_ngram, ..., 1 and taking the most recent match of the last n
    tokens, but it looks only at the positions holding the last token (numpy finds them).
    """
    n_tokens = len(history)
    if n_tokens < 2:
        return None
    ids = np.asarray(history, dtype=np.int64)
    ends = np.flatnonzero(ids[:-1] == ids[-1])  # earlier positions of the last token, ascending
    best: SuffixMatch | None = None
    for end in ends[::-1].tolist():  # most recent first: a later match wins ties
        length = 1
        while length < max_ngram and end - length >= 0 and ids[end - length] == ids[n_tokens - 1 - length]:
            length += 1
        if best is None or length > best.length:
            best = SuffixMatch(length, end)
            if length == max_ngram:
                break
    return best
