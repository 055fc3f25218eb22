"""Draft as many tokens as pay for themselves: `KIND:auto` (e.g. `hspec:auto`, `hspec+ngram:auto`).

A speculative step is only worth its cost when it emits more tokens per unit of time than plain decoding.
On a CPU neither the draft nor the verify is free: with the w4a8 target a propose of the shipped H-Spec
drafter costs about a decode and a half, and each drafted token adds a tenth of a decode or more to the
verify (docs/design.md#the-decoding-step, `drafters/step_cost.py`). So each step, each row:

1. If the row is backing off (step 3), it drafts nothing: its step verifies x0 alone, a plain decode, and
   the drafter does not run for it. Where the drafter ships an outlook (`drafters/outlook.py`: from the
   target's hidden states at the row's last committed token, how far the drafts will be accepted), the
   outlook decides instead of the back-off: the row drafts when the best length by the outlook's estimates
   is expected to emit at least as many tokens per decode's cost as a plain step (`Outlook.margin`). Where
   the draft's cost grows with the positions drafted (`StepCost.draft_per_position`: on a Zen 1 EPYC a
   1-position H-Spec draft costs 0.22 of a decode, 7 positions 0.61), it drafts only that length, m, and
   verifies at most m; where the draft costs the same at any length, all K. (H-Spec's block is causal, so its
   m drafts are the first m of K; a drafter whose block is not, as DFlash's, drafts m otherwise.)
2. Otherwise the drafter proposes K tokens (or step 1's m) with an estimate a_k that draft k is accepted given
   the drafts before it were: its confidence c_k (the largest probability of its distribution at k, before the
   sampling transform) where it reports one, scaled by the row's own record of how often it accepted the
   drafter's drafts at k against the confidence they had (a drafter sure of drafts the target keeps rejecting, as a
   chat-trained drafter on translation, stops being believed); else (prompt lookup, n-gram: drafts without
   a distribution) the row's record alone, the share of its earlier such steps that accepted position k once
   they reached it (with a prior of two steps at a_{k-1}, and 0.5 for a_1), one record for lookups after a
   match of 1 token, one for 2 and one for 3 or more (`lookup_bucket`): on Spec-Bench a 4-token match is
   accepted about 2.5 times as far as a 1-token one (`results/lookup_match_stats.md`), and one record for
   both verified too many drafts after short matches and too few after long ones (replayed on recorded
   outputs: `scripts/simulate_lookup.py`). The row verifies drafts while
   each one raises the step's rate, tokens per decode's cost:

       rate(n) = E(n) / cost(n),   E(n) = 1 + sum_{k<=n} prod_{j<=k} a_j,
       cost(n) = draft + 1 + [n > 0] first + n (t + t_S S)

   (StepCost; S the row's context; a row drafted without a model, `Drafter.lookup_matches`, pays no draft). Draft
   n + 1 goes in while some longer block pays more than the n drafts do, with a_k from this step up to n + 1
   and, after it, the row's record alone (its acceptance per position on earlier steps): so a first draft
   that pays only with the ones behind it (the first verified token costs a surcharge) is still taken.
   Deciding draft by draft, rather than taking the best n over all K, keeps sampling exact: whether d_k is
   verified then depends on a_1..a_k, which depend on d_1..d_{k-1} and earlier steps only
   (`Proposal.confidence`), and on the record, never on d_k or the drafts after it.
3. When even the best n emits less than 1 token per decode's cost, drafting did not pay for this row:
   it skips its next steps (`Backoff`). A row whose drafting has never paid skips 128 steps each time (it
   probes once every 129 steps); once some step of the row has paid, it skips 2 steps at first, six times
   as many each time drafting again does not pay (2, 12, 72), at most 128, and a step that pays resets
   that. So a drafter that never pays for a row costs it one probe every 129 steps, and one that pays on
   some stretches of a row's text drafts there and looks again soon after a stretch ends. Rows a drafter
   drafts for free (prompt lookup's matches) draft in any case and leave the back-off alone. Why these
   numbers: each probe costs a whole draft (about 0.7 of a decode for H-Spec under a w4a8 target on a
   2-core CPU) and, where drafting does not pay, wins ~0.3 tokens. Replayed on 80 Spec-Bench items outside
   `hspec eval`'s (`scripts/simulate_backoff.py`, `results/adaptive_length/backoff_sim/`), growing the skip
   sixfold from 2 kept more of every task's speed than doubling from 1; and a row whose first probes did not
   pay rarely paid later in a 128-token answer, so such a row probing once every 129 steps instead of four
   times in its first 90 raised the worst task's predicted speed by 1-2% on both CPUs' step costs, math,
   where drafting pays, keeping its gain (`backoff_sim/zen1/`, `backoff_sim/zen1_records_xeon_costs/`).

Losslessness is untouched: how many drafts a row verifies, and whether it drafts at all, depends only on
that row's own earlier steps, its drafts before the one in question and their confidences, never on this
step's verdict, and the verifier treats a row with n drafts exactly as a block of n (n = 0: the target's
own token). The rule keeps no timing and no state shared between rows, so a row drafts the same in any
batch; its backoff and record follow it through a preemption (`carried_state`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DraftBatch, Drafter, Proposal, one_hot_probs
from hspec.drafters.outlook import Outlook
from hspec.drafters.step_cost import StepCost
from hspec.drafters.wrapping import WrappingDrafter

ADAPTIVE_LENGTH = "auto"  # the P of `KIND:P` that asks for the cost-aware length
LOOKUP_MATCH_BUCKETS = 3  # lookup drafts judged by a record per match length: 1, 2, and 3 or more tokens


@dataclass(frozen=True)
class Backoff:
    """How many steps a row skips drafting after drafting did not pay (module docstring, step 3): while none of
    the row's drafting has paid yet, `cold` steps each time (0: no such rule, the skips below from the start);
    after, `first` after the first such step, `growth` times the last skip after each further one, never more
    than `most`."""

    first: int = 2
    growth: int = 6
    most: int = 128
    cold: int = 128

    def __post_init__(self) -> None:
        if not (1 <= self.first <= self.most and self.growth >= 1 and self.cold >= 0):
            raise ValueError(f"a back-off needs 1 <= first <= most, growth >= 1 and cold >= 0, got first="
                             f"{self.first}, growth={self.growth}, most={self.most}, cold={self.cold}")

    def after(self, skip: int, paid: bool) -> int:
        """The next skip after a skip of `skip` steps (0: none yet), for a row whose drafting has (`paid`) or has
        not yet paid on some step."""
        if self.cold and not paid:
            return self.cold
        return min(max(self.first, self.growth * skip), self.most)


def best_draft_length(estimate: Sequence[float], keys: int, cost: StepCost,
                      outlook: Sequence[float] = (), positions: int | None = None,
                      to_draft: bool = False) -> tuple[int, float]:
    """One row's draft length (module docstring, step 2) and its rate in tokens per 1-token decode.

    estimate: the row's a_1..a_K for this step's drafts; outlook: what the row's record alone expects at each
    position (a_k from earlier steps only). Draft n + 1 is verified when some block n + 1..K pays more than
    the n drafts do, its a_k being estimate's up to n + 1 and outlook's after: a draft whose own estimate is
    low still goes in when the drafts expected after it make up for it (the first drafted token's surcharge,
    `StepCost.first_token`, is paid once), and the choice of draft n + 1 reads nothing of drafts n + 2..K.
    positions: the positions the drafter drafted, paid whatever is verified (default: one per estimate);
    to_draft: before drafting, the length n to draft and verify (n = 0: a plain step, the drafter does not run)."""
    K = len(estimate)
    drafted = K if positions is None else positions
    # a step verifying 0..K drafts
    costs = [cost.of(length, keys, length if to_draft else drafted) for length in range(K + 1)]
    n, rate = 0, 1.0 / costs[0]
    emitted, reach = 1.0, 1.0  # E(n) and prod_{j<=n} a_j
    while n < K:
        reach_next = reach * float(estimate[n])
        emitted_next = emitted + reach_next
        best, ahead, reach_ahead = emitted_next / costs[n + 1], emitted_next, reach_next
        for m in range(n + 1, min(K, len(outlook))):  # the block through draft m + 1 as the outlook sees it
            reach_ahead *= float(outlook[m])
            ahead += reach_ahead
            best = max(best, ahead / costs[m + 1])
        if best <= rate:
            break
        n, emitted, reach = n + 1, emitted_next, reach_next
        rate = emitted / costs[n]
    return n, rate


def outlook_length(outlook: Sequence[float], keys: int, cost: StepCost, margin: float = 1.0) -> int:
    """How many positions a row whose outlook expects a_1..a_K (`Outlook.estimates`) drafts (module docstring,
    step 1): the best draft length by them, drafting only it, where it emits at least `margin` tokens per
    decode's cost, the draft's included; else 0 (the row does not draft)."""
    n, rate = best_draft_length(outlook, keys, cost, to_draft=True)
    return n if n and rate >= margin else 0


@dataclass
class Record:
    """A row's verdicts per draft position k: steps whose verify reached k (every earlier draft accepted),
    those that accepted draft k, and the sum of the drafter's confidence at k over the steps that reached it."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)

    def grow(self, K: int) -> None:
        extra = K - len(self.reached)
        if extra > 0:
            self.reached += [0] * extra
            self.accepted += [0] * extra
            self.confidence += [0.0] * extra

    def add(self, verified: int, num_accepted: int, confidence: Sequence[float] | None) -> None:
        """A step verified `verified` drafts (with these confidences, if any) and accepted `num_accepted`."""
        self.grow(verified)
        for k in range(min(num_accepted + 1, verified)):
            self.reached[k] += 1
            self.accepted[k] += k < num_accepted
            self.confidence[k] += 0.0 if confidence is None else confidence[k]

    def estimates(self, K: int) -> list[float]:
        """a_1..a_K for drafts without a confidence: (accepted_k + 2 a_{k-1}) / (reached_k + 2), a_0 = 0.5, a
        prior of two steps centred on the position before (a row whose drafts keep being accepted tries further)."""
        self.grow(K)
        out, prior = [], 0.5
        for a, r in zip(self.accepted[:K], self.reached[:K]):
            prior = (a + 2 * prior) / (r + 2)
            out.append(prior)
        return out

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        """a_k = min(1, c_k f_k): the drafter's confidence scaled by how often this row accepted its drafts at k
        against how often the drafter said it would, f_k = (accepted_k + f_{k-1}) / (sum of c_k + 1), f_0 = 1
        (a prior worth one sure draft at the position before's factor, which a position never reached keeps)."""
        self.grow(len(confidence))
        out, factor = [], 1.0
        for c, a, s in zip(confidence, self.accepted, self.confidence):
            factor = (a + factor) / (s + 1)
            out.append(min(1.0, c * factor))
        return out

    def copy(self) -> Record:
        return Record(list(self.reached), list(self.accepted), list(self.confidence))


def lookup_bucket(match_length: int) -> int:
    """Which record judges a lookup row's drafts: one per length of the match they continue, 1, 2, and 3 or
    more tokens (0: the drafter did not say)."""
    return min(match_length, LOOKUP_MATCH_BUCKETS)


@dataclass
class RowState:
    """What the rule keeps for one row: its place in the back-off of step 3 (steps still to skip, the length
    of the last skip, whether some step of it has paid), its records of the model's drafts and of drafts
    without a confidence (step 2; those per `lookup_bucket`), and this step's verified drafts with their
    confidences (None: drafts without one) and lookup bucket until `commit` tells the verdict; and, with an
    outlook, what it expects from the target's hidden states at the row's last committed token, a_1..a_K."""

    skip: int = 0
    backoff: int = 0
    paid: bool = False  # some step of this row drafted at a rate that paid
    model: Record = field(default_factory=Record)
    lookup: dict[int, Record] = field(default_factory=dict)
    pending: tuple[int, list[float] | None, int] | None = None
    outlook: list[float] | None = None  # `Outlook.estimates`, replaced at each commit

    def takes_turn(self) -> bool:
        """Whether the row may draft this step (it is not backing off); counts a skipped step down."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def after_draft(self, rate: float, backoff: Backoff) -> None:
        """Update the back-off after a step that drafted at `rate` tokens per decode's cost."""
        if rate >= 1.0:
            self.backoff, self.paid = 0, True
        else:
            self.backoff = backoff.after(self.backoff, self.paid)
            self.skip = self.backoff

    def choose(self, confidence: Sequence[float], keys: int, cost: StepCost, backoff: Backoff,
               positions: int | None = None) -> int:
        """How many of a model's drafts, with confidences c_1..c_K, to verify (module docstring, step 2), the
        back-off updated and the drafts kept pending until `record` tells their verdict. positions: those the
        drafter drafted (default: one per confidence)."""
        outlook = self.model.estimates(len(confidence))
        n, rate = best_draft_length(self.model.calibrated(confidence), keys, cost, outlook, positions)
        self.after_draft(rate, backoff)
        self.pending = (n, list(confidence[:n]), 0) if n else None
        return n

    def choose_lookup(self, limit: int, K: int, keys: int, cost: StepCost, match_length: int) -> int:
        """How many of at most `limit` drafts without a confidence (a lookup's, after a match of `match_length`
        tokens; 0: not said) to verify, by the row's record of such drafts after matches of that length (module
        docstring, step 2), the drafts kept pending until `record` tells their verdict. Free drafts: no back-off."""
        n = self.lookup_length(limit, K, keys, cost, match_length)
        self.pending = (n, None, lookup_bucket(match_length)) if n else None
        return n

    def lookup_length(self, limit: int, K: int, keys: int, cost: StepCost, match_length: int) -> int:
        """`choose_lookup`'s length, nothing kept. With limit = K, 0 means 0 at any limit: a shorter block
        only leaves out blocks the rule could take."""
        outlook = self.lookup.setdefault(lookup_bucket(match_length), Record()).estimates(K)  # (limit) is its first
        return best_draft_length(outlook[:limit], keys, cost, outlook)[0]

    def record(self, num_accepted: int) -> None:
        """This step's verdict: `num_accepted` of its pending drafts were accepted."""
        if self.pending is not None:
            verified, confidence, bucket = self.pending
            (self.lookup[bucket] if confidence is None else self.model).add(verified, num_accepted, confidence)
        self.pending = None

    def copy(self) -> RowState:
        return RowState(self.skip, self.backoff, self.paid, self.model.copy(),
                        {bucket: record.copy() for bucket, record in self.lookup.items()}, self.pending, self.outlook)


class RowStateDrafter(WrappingDrafter):
    """A wrapper that keeps a `RowState` per sequence (`_rows`): forgotten on release, carried through a
    preemption with the wrapped drafter's own state."""

    def __init__(self, model: Drafter) -> None:
        super().__init__(model)
        self._rows: dict[int, RowState] = {}

    def _state(self, seq_id: int) -> RowState:
        state = self._rows.get(seq_id)
        if state is None:
            state = self._rows[seq_id] = RowState()
        return state

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        super().release(seq_id)

    def carried_state(self, seq_id: int) -> object | None:
        state = self._rows.get(seq_id)
        inner = self.model.carried_state(seq_id)
        if state is None and inner is None:
            return None
        return (state.copy() if state else None, inner)

    def restore_carried_state(self, seq_id: int, state: object | None) -> None:
        if state is None:
            return
        own, inner = state  # what carried_state returned
        if own is not None:
            self._rows[seq_id] = own.copy()
        self.model.restore_carried_state(seq_id, inner)


class CostAwareDrafter(RowStateDrafter):
    """`model`'s proposals, each row verifying the number of drafts that pays most per step cost, and drafting
    nothing while it backs off after drafts that did not pay (module docstring)."""

    def __init__(self, model: Drafter, vocab_size: int, cost: StepCost, backoff: Backoff = Backoff(),
                 outlook: Outlook | None = None) -> None:
        if not model.drafts:
            raise ValueError(f"drafter {model.kind!r} drafts nothing; there is no draft length to choose")
        if outlook is not None and tuple(outlook.layers) != tuple(model.target_layers):
            raise ValueError(f"the outlook reads target layers {list(outlook.layers)}, but drafter {model.kind!r} "
                             f"is handed layers {list(model.target_layers)}: an outlook belongs to its checkpoint")
        super().__init__(model)
        self.vocab_size = vocab_size
        self.cost = cost
        # a row drafted without the model
        self.free_cost = replace(cost, draft=0.0, draft_per_key=0.0, draft_per_position=0.0)
        self.backoff = backoff
        self.outlook = outlook
        self.kind = f"{model.kind}:{ADAPTIVE_LENGTH}"
        self._plain: dict[tuple[int, int, torch.device], Proposal] = {}  # (B, K, device) -> `_plain_step`'s

    @property
    def lookup_rows(self) -> int | None:  # type: ignore[override]
        return self.model.lookup_rows

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        B = len(batch.seq_ids)
        device = batch.anchor_tokens.device
        states = [self._state(s) for s in batch.seq_ids]
        contexts = batch.pool.lengths(batch.seq_ids)  # each row's keys, read once a step
        # A row the drafter drafts by a lookup match (free) drafts whether or not it takes a turn, where its
        # record after such matches lets some drafts pay; where it lets none, the drafts would all be cut, so the
        # drafter is not asked for them.
        turns = [self._positions(state, keys, K) for state, keys in zip(states, contexts)]
        matches = self.model.lookup_matches(batch)
        positions = [(K if states[row].lookup_length(K, K, contexts[row], self.free_cost, matches[row]) > 0 else 0)
                     if matches[row] else turns[row] for row in range(B)]
        for state in states:
            state.pending = None
        if not any(positions):
            return self._plain_step(B, K, device)
        num_drafts = [0] * B
        tokens = None  # (B, K); past a row's drafts: padding, never verified
        probs = None  # (B, K, V) where some row's drafts have distributions
        for m in sorted(set(positions) - {0}):  # rows drafting m positions, in one call (one, mostly)
            rows = [row for row in range(B) if positions[row] == m]
            drafted = self.model.propose(batch.select(rows), m)
            if len(rows) == B and m == K:  # every row drafts the whole block: the proposal as it is
                tokens, probs = drafted.draft_tokens, drafted.draft_probs
            else:
                if tokens is None:
                    tokens = torch.zeros((B, K), dtype=torch.long, device=device)
                index = slice(None) if len(rows) == B else torch.tensor(rows, dtype=torch.long, device=device)
                tokens[index, :m] = drafted.draft_tokens
                if drafted.draft_probs is not None or probs is not None:
                    if probs is None:  # earlier groups' one-hot drafts, now written out
                        probs = one_hot_probs(tokens, self.vocab_size)
                    probs[index, :m] = drafted.probs(self.vocab_size)
            limits = [m] * len(rows) if drafted.num_drafts is None else drafted.num_drafts.tolist()
            confidence = None if drafted.confidence is None else drafted.confidence.float().tolist()
            matched = [0] * len(rows) if drafted.match_length is None else drafted.match_length.tolist()
            for i, row in enumerate(rows):
                state = states[row]
                # Drafts without a model's confidence (lookup, n-gram) were drafted without a model: free, so
                # they cannot fail to pay and leave the back-off alone.
                if confidence is not None and not math.isnan(confidence[i][0]):
                    num_drafts[row] = state.choose(confidence[i][: limits[i]], contexts[row], self.cost,
                                                   self.backoff, positions=m)
                    continue
                num_drafts[row] = state.choose_lookup(limits[i], K, contexts[row], self.free_cost, matched[i])
        return Proposal(tokens, probs, torch.tensor(num_drafts, dtype=torch.long, device=device))

    def _plain_step(self, B: int, K: int, device: torch.device) -> Proposal:
        """A step where no row drafts: a plain decode, verified against an empty draft. Made once per shape (most
        steps of a row that does not pay are such steps) and never written to."""
        key = (B, K, device)
        if key not in self._plain:
            probs = torch.zeros((1, 1, 1), dtype=torch.float32, device=device).expand(B, K, self.vocab_size)
            self._plain[key] = Proposal(torch.zeros((B, K), dtype=torch.long, device=device), probs,
                                        torch.zeros(B, dtype=torch.long, device=device))
        return self._plain[key]

    def _positions(self, state: RowState, keys: int, K: int) -> int:
        """How many positions the model drafts for the row this step (0: none; module docstring, step 1): by the
        outlook where there is one and the row has committed a token, the length it expects to pay best (all K
        where the draft costs the same whatever its length: its confidences may then verify more), else by the
        back-off, K or 0."""
        if self.outlook is None or state.outlook is None:
            return K if state.takes_turn() else 0
        length = outlook_length(state.outlook[:K], keys, self.cost, self.outlook.margin)
        return length if length == 0 or self.cost.draft_per_position > 0 else K

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """After a step (or a prefill), each row that verified drafts adds the verdict to its record; with an
        outlook, each row keeps what it expects from the hidden states of its last committed token,
        hidden[b, num_committed[b] - 1]."""
        for row, (seq_id, committed) in enumerate(zip(seq_ids, num_committed.tolist())):
            state = self._state(seq_id)
            state.record(committed - 1)  # committed = x0 + the accepted drafts
            if self.outlook is not None and hidden is not None:
                state.outlook = self.outlook.estimates(hidden[row, committed - 1])  # from (len(layers), H)
        super().commit(pool, seq_ids, hidden, num_committed)
