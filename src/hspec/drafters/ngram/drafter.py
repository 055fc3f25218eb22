"""Model-free prompt-lookup drafting (Saxena, 2023).

Find the most recent earlier occurrence of the history's last n tokens (n from `max_ngram` down to
`min_ngram`) and propose the K tokens that followed it. Proposals are deterministic, so the draft
distribution is one-hot; stochastic verification then accepts d_k with probability p(d_k), which
keeps sampling exact. A row without a match drafts nothing: its step is a plain decode (the last token
repeated, what it would otherwise propose, is a guess the target rejects, and each verified guess costs a
verify row). Each row reports its match's length (`Proposal.match_length`), which `ngram:auto` keeps a record per.
"""

from __future__ import annotations

import torch

from hspec.drafters.base import DRAFTERS, DraftBatch, Drafter, Proposal
from hspec.drafters.ngram.suffix import SuffixMatcher
from hspec.models.config import TargetConfig


@DRAFTERS.register("ngram")
class NgramDrafter(Drafter):
    def __init__(self, config: TargetConfig, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.vocab_size = config.vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._matcher = SuffixMatcher(max_ngram)

    def lookup_matches(self, batch: DraftBatch) -> list[int]:
        matches = [self._matcher.match(seq_id, history) for seq_id, history in zip(batch.seq_ids, batch.tokens)]
        return [m.length if m is not None and m.length >= self.min_ngram else 0 for m in matches]

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        device = batch.anchor_tokens.device
        matches = [self._matcher.match(seq_id, history) for seq_id, history in zip(batch.seq_ids, batch.tokens)]
        lengths = [m.length if m is not None and m.length >= self.min_ngram else 0 for m in matches]
        rows = [m.continuation(history, K) if length else [history[-1]] * K
                for m, length, history in zip(matches, lengths, batch.tokens)]
        tokens = torch.tensor(rows, dtype=torch.long, device=device)  # (B, K)
        num_drafts = None if all(lengths) else torch.tensor([K if length else 0 for length in lengths], device=device)
        # deterministic drafts: one-hot distributions (`Proposal.probs`)
        return Proposal(tokens, None, num_drafts, match_length=torch.tensor(lengths, device=device))

    def release(self, seq_id: int) -> None:
        self._matcher.release(seq_id)
