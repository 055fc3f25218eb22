"""Draft as many tokens as pay for themselves: `KIND:auto` (e.g. `hspec:auto`, `hspec+ngram:auto`).

A speculative step is only worth its cost when it emits more tokens per unit of time than plain decoding.
On a CPU neither the draft nor the verify is free: with the w4a8 target a propose of the shipped H-Spec
drafter costs about a decode and a half, and each drafted token adds a tenth of a decode or more to the
verify (docs/design.md#the-decoding-step, `drafters/step_cost.py`). So each step, each row:

1. If the row is backing off (below), it drafts nothing: its step verifies x0 alone, a plain decode, and
   the drafter does not run for it.
2. Otherwise the drafter proposes K tokens with its confidence c_k at each position (the largest
   probability of its distribution there, before the sampling transform), and the row verifies drafts
   while each one raises the step's rate, tokens per decode's cost:

       rate(n) = E(n) / cost(n),   E(n) = 1 + sum_{k<=n} prod_{j<=k} c_j,   cost(n) = draft + 1 + n (t + t_S S)

   (StepCost; S the row's context; c_k read as the chance that draft k is accepted given the drafts
   before it were): n is the first n with rate(n + 1) <= rate(n). Stopping at the first draft that does
   not pay, rather than taking the best n over all K, keeps sampling exact: whether d_k is verified then
   depends on c_1..c_k, which depend on d_1..d_{k-1} only (`Proposal.confidence`), never on d_k or the
   drafts after it. With confidences that fall along the block, as a drafter's do, both choose alike.
3. When even the best n emits less than 1 token per decode's cost, drafting did not pay for this row:
   it skips its next `backoff` steps, the backoff doubling (1, 2, 4, ...) up to `max_backoff` while
   drafting keeps not paying; a step that pays resets it. So a drafter that never pays costs one probe
   every max_backoff + 1 steps, and one that pays on some stretches of text drafts there.

Losslessness is untouched: how many drafts a row verifies, and whether it drafts at all, depends only on
that row's own drafts and confidences, never on the target's verdict, and the verifier treats a row with n
drafts exactly as a block of n (n = 0: the target's own token). The rule keeps no timing and no state
shared between rows, so a row drafts the same in any batch; its backoff follows it through a preemption
(`carried_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.step_cost import StepCost, expected_emitted
from hspec.drafters.wrapping import WrappingDrafter

ADAPTIVE_LENGTH = "auto"  # the P of `KIND:P` that asks for the cost-aware length
MAX_BACKOFF = 32  # most steps a row skips drafting after drafting did not pay


def best_draft_length(confidence: Sequence[float], keys: int, cost: StepCost) -> tuple[int, float]:
    """One row's draft length (module docstring, step 2): the n in 0..K after which the next draft would
    not raise E(n) / cost(n), and that rate in tokens per 1-token decode. confidence: the row's c_1..c_K."""
    n, rate = 0, 1.0 / cost.of(0, keys)
    while n < len(confidence):
        longer = expected_emitted(confidence[: n + 1]) / cost.of(n + 1, keys)
        if longer <= rate:
            break
        n, rate = n + 1, longer
    return n, rate


@dataclass
class Backoff:
    """One row's place in the back-off of step 3: steps still to skip, and the length of the last skip."""

    skip: int = 0
    length: int = 0

    def after_draft(self, rate: float, max_backoff: int) -> None:
        """Update after a step that drafted at `rate` tokens per decode's cost."""
        if rate >= 1.0:
            self.length = 0
        else:
            self.length = min(max(1, 2 * self.length), max_backoff)
            self.skip = self.length


class CostAwareDrafter(WrappingDrafter):
    """`model`'s proposals, each row verifying the number of drafts that maximises tokens per step cost,
    and drafting nothing while it backs off after drafts that did not pay (module docstring)."""

    def __init__(self, model: Drafter, vocab_size: int, cost: StepCost, max_backoff: int = MAX_BACKOFF) -> None:
        if not model.drafts:
            raise ValueError(f"drafter {model.kind!r} drafts nothing; there is no draft length to choose")
        if max_backoff < 0:
            raise ValueError(f"max_backoff must be >= 0 steps, got {max_backoff}")
        super().__init__(model)
        self.vocab_size = vocab_size
        self.cost = cost
        self.max_backoff = max_backoff
        self.kind = f"{model.kind}:{ADAPTIVE_LENGTH}"
        self._backoff: dict[int, Backoff] = {}

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        B = len(batch.seq_ids)
        device = batch.anchor_tokens.device
        states = [self._backoff.setdefault(s, Backoff()) for s in batch.seq_ids]
        drafting = [row for row, state in enumerate(states) if state.skip == 0]
        for state in states:
            state.skip = max(state.skip - 1, 0)
        tokens = torch.zeros((B, K), dtype=torch.long, device=device)  # (B, K); rows that skip: padding
        num_drafts = [0] * B
        if not drafting:  # nobody drafts: a plain decode step, verified against an empty draft
            probs = torch.zeros((1, 1, 1), dtype=torch.float32, device=device).expand(B, K, self.vocab_size)
            return Proposal(tokens, probs, torch.zeros(B, dtype=torch.long, device=device))
        drafted = self.model.propose(batch.select(drafting), K)
        if drafted.confidence is None:
            raise ValueError(f"drafter {self.model.kind!r} reports no draft confidence to choose a length from")
        limits = [K] * len(drafting) if drafted.num_drafts is None else drafted.num_drafts.tolist()
        keys = batch.pool.lengths([batch.seq_ids[row] for row in drafting])
        for i, (row, confidence) in enumerate(zip(drafting, drafted.confidence.float().tolist())):
            n, rate = best_draft_length(confidence[: limits[i]], keys[i], self.cost)
            num_drafts[row] = n
            states[row].after_draft(rate, self.max_backoff)
        if len(drafting) == B:
            tokens, probs = drafted.draft_tokens, drafted.draft_probs
        else:
            index = torch.tensor(drafting, dtype=torch.long, device=device)
            tokens[index] = drafted.draft_tokens
            probs = torch.zeros((B, K, self.vocab_size), dtype=drafted.draft_probs.dtype, device=device)  # (B, K, V)
            probs[index] = drafted.draft_probs
        confidence = torch.zeros((B, K), dtype=drafted.confidence.dtype, device=device)  # (B, K)
        confidence[torch.tensor(drafting, dtype=torch.long, device=device)] = drafted.confidence
        return Proposal(tokens, probs, torch.tensor(num_drafts, dtype=torch.long, device=device), confidence)

    def release(self, seq_id: int) -> None:
        self._backoff.pop(seq_id, None)
        super().release(seq_id)

    def carried_state(self, seq_id: int) -> object | None:
        backoff = self._backoff.get(seq_id)
        inner = self.model.carried_state(seq_id)
        if backoff is None and inner is None:
            return None
        return (Backoff(backoff.skip, backoff.length) if backoff else None, inner)

    def restore_carried_state(self, seq_id: int, state: object | None) -> None:
        if state is None:
            return
        backoff, inner = state  # what carried_state returned
        if backoff is not None:
            self._backoff[seq_id] = Backoff(backoff.skip, backoff.length)
        self.model.restore_carried_state(seq_id, inner)
