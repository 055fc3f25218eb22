"""Model-free prompt-lookup drafting (Saxena, 2023).

Find the most recent earlier occurrence of the history's last n tokens (n from `max_ngram` down to
`min_ngram`) and propose the K tokens that followed it. Proposals are deterministic, so the draft
distribution is one-hot; stochastic verification then accepts d_k with probability p(d_k), which
keeps sampling exact. With no match, the drafts repeat x0: cheap guesses the target rejects freely.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hspec.drafters.base import DRAFTERS, DraftBatch, Drafter, Proposal, one_hot_probs
from hspec.models.config import TargetConfig


@DRAFTERS.register("ngram")
class NgramDrafter(Drafter):
    def __init__(self, config: TargetConfig, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.vocab_size = config.vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        rows = [lookup_continuation(history, K, self.max_ngram, self.min_ngram) for history in batch.tokens]
        tokens = torch.tensor(rows, dtype=torch.long, device=batch.anchor_tokens.device)  # (B, K)
        return Proposal(tokens, one_hot_probs(tokens, self.vocab_size))


def lookup_continuation(history: Sequence[int], K: int, max_ngram: int, min_ngram: int) -> list[int]:
    """K tokens continuing `history` by its latest earlier n-gram match, padded with the last token."""
    n_tokens = len(history)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = list(history[n_tokens - n:])
        # Scan backwards so the most recent match wins; a match must leave >= 1 token after it.
        for start in range(n_tokens - n - 1, -1, -1):
            if list(history[start:start + n]) == tail:
                follow = list(history[start + n:start + n + K])
                return follow + [history[-1]] * (K - len(follow))
    return [history[-1]] * K
