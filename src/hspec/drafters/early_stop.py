"""Verify only the drafts the drafter is sure of: `KIND:P` (e.g. `hspec:0.4`, `hspec+ngram:0.4`).

A block drafter drafts all K positions in one pass, but the target pays for every position it
verifies: on a 2-core CPU a verify of 4 tokens costs about 1.3 decode steps and one of 8 about 1.8
(results/decode_cpu.md), while late drafts of a weak drafter are rarely accepted. So each row
verifies only its leading drafts whose confidence (the drafter's own probability of the draft,
before the sampling transform) is at least P, and always at least one. K stays the most a step
can draft; the drafter still runs once per step.

P = 0.4 is the suggested floor for the shipped SmolLM2 drafter. On 18 Spec-Bench items outside
`hspec eval`'s subset (`scripts/tune_on_dev_items.py`; K = 7, greedy, 2-core CPU), tau / speed:
| drafter | P = 0.3 | P = 0.4 | P = 0.5 | all K verified |
|---|---|---|---|---|
| hspec+ngram | 2.24 / 1.42x | 2.22 / 1.43x | 2.19 / 1.41x | 2.32 / 1.23x |
| hspec alone | - | 1.57 / 0.89x | - | 1.65 / 0.73x |

Losslessness is untouched: how many drafts a row verifies depends only on the drafter's own output
for that row, never on the target's verdict, and `verify` treats a row with n drafts exactly as
a block of n (see `decoding/verify.py`).
"""

from __future__ import annotations

import torch

from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.wrapping import WrappingDrafter

CONFIDENCE_SEPARATOR = ":"


def leading_confident(confidence: torch.Tensor, floor: float) -> torch.Tensor:
    """(B, K) confidences -> (B,) long: leading drafts with confidence >= floor, at least 1."""
    sure = (confidence >= floor).long().cumprod(-1).sum(-1)  # (B,)
    return sure.clamp(min=1)


class EarlyStopDrafter(WrappingDrafter):
    """`model`'s proposals, each row cut after its leading drafts of confidence >= `floor`."""

    def __init__(self, model: Drafter, floor: float) -> None:
        if not model.drafts:
            raise ValueError(f"drafter {model.kind!r} drafts nothing; there are no drafts to stop early")
        if not 0.0 < floor < 1.0:
            raise ValueError(f"confidence floor must be in (0, 1), got {floor}")
        super().__init__(model)
        self.floor = floor
        self.kind = f"{model.kind}{CONFIDENCE_SEPARATOR}{floor:g}"

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        proposal = self.model.propose(batch, K)
        if proposal.confidence is None:
            raise ValueError(f"drafter {self.model.kind!r} reports no draft confidence to stop on")
        num_drafts = leading_confident(proposal.confidence, self.floor)
        if proposal.num_drafts is not None:
            num_drafts = torch.minimum(num_drafts, proposal.num_drafts)
        return Proposal(proposal.draft_tokens, proposal.draft_probs, num_drafts, proposal.confidence)
