"""`none`: plain autoregressive decoding through the same loop (K = 0, nothing drafted)."""

from __future__ import annotations

import torch

from hspec.drafters.base import DRAFTERS, DraftBatch, Drafter, Proposal
from hspec.models.config import TargetConfig

# The kind of plain decoding, and so the label of the baseline rows every speculative row is compared with.
PLAIN = "none"


@DRAFTERS.register(PLAIN)
class PlainDecoding(Drafter):
    drafts = False

    def __init__(self, config: TargetConfig) -> None:
        self.vocab_size = config.vocab_size

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        b = batch.anchor_tokens.shape[0]
        device = batch.anchor_tokens.device
        return Proposal(torch.empty((b, 0), dtype=torch.long, device=device),
                        torch.empty((b, 0, self.vocab_size), device=device))
