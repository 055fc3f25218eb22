"""Prompt lookup first, a trained drafter otherwise: `KIND+ngram` (e.g. `hspec+ngram`).

A small target copies a lot: a translation prompt's German sentence, a summarised article's
phrases, its own repetition loops. Prompt lookup drafts such stretches for free and exactly, while a
parallel drafter trained on ordinary chat rarely learns to copy K tokens ahead (H-Spec trained so
accepted 1.19 tokens per step on Spec-Bench translation, where lookup gets 2.27). So, per row
and per step: when the history's last `min_match` or more tokens occurred earlier, the row takes the
tokens that followed their latest occurrence (the `ngram` drafter's proposal); otherwise the trained
drafter drafts it. When every row has a match, the trained drafter does not run at all that step.

min_match = 1 (look up whenever the last token occurred before) is the default: on 18 Spec-Bench
items outside `hspec eval`'s subset (K = 7, SmolLM2-135M) it gave tau 2.35 / 1.20x plain decoding,
against 2.29 / 1.09x for min_match 2, 2.18 / 1.02x for 3, and 1.62 / 0.72x for H-Spec alone.

With `trim_lookup` (the `KIND+ngram:P` form) a lookup row
verifies min(K, 2m+1) of its K drafts after an m-token match: on the 18 dev items (K = 7,
`results/lookup_match_stats.md`, made by `scripts/lookup_match_stats.py`), lookup after a 1-token match
got 0.81 drafts accepted on average, after 2 tokens 1.65, after 4 tokens 2.07, so the target should
not pay for seven drafts behind a short match.

Losslessness is untouched: each row's draft distribution is the one its drafts were drawn from
(one-hot for lookup rows), and the verifier does the rest. The trained drafter still sees every
commit, so its per-sequence state (H-Spec: the last hidden states) stays current while lookup
drafts. Choosing a row depends only on that row's history, so a row drafts the same in any batch.
"""

from __future__ import annotations

import torch

from hspec.drafters.base import DraftBatch, Drafter, Proposal, one_hot_probs
from hspec.drafters.early_stop import CONFIDENCE_SEPARATOR, EarlyStopDrafter
from hspec.drafters.ngram.suffix import SuffixMatcher
from hspec.drafters.wrapping import WrappingDrafter

LOOKUP_SUFFIX = "+ngram"


class LookupFirstDrafter(WrappingDrafter):
    """Prompt lookup for rows whose last >= min_match tokens recur in their history, `model` for the rest.

    min_match: shortest suffix match that makes a row use lookup (1: whenever the last token occurred
    before). max_ngram: longest suffix compared; the latest occurrence of the longest match wins.
    trim_lookup: a lookup row after an m-token match verifies only min(K, 2m+1) drafts.
    """

    def __init__(self, model: Drafter, vocab_size: int, min_match: int = 1, max_ngram: int = 8,
                 trim_lookup: bool = False) -> None:
        if not model.drafts:
            raise ValueError(f"drafter {model.kind!r} drafts nothing; lookup needs a drafter to fall back on")
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got min_match {min_match}, max_ngram {max_ngram}")
        super().__init__(model)
        self.vocab_size = vocab_size
        self.min_match, self.max_ngram = min_match, max_ngram
        self.trim_lookup = trim_lookup
        if isinstance(model, EarlyStopDrafter):  # hspec:0.4 behind lookup is named hspec+ngram:0.4
            self.kind = f"{model.model.kind}{LOOKUP_SUFFIX}{CONFIDENCE_SEPARATOR}{model.floor:g}"
        else:
            self.kind = model.kind + LOOKUP_SUFFIX
        self.lookup_rows = 0  # rows drafted by lookup so far (with model_rows: how often each drafted)
        self.model_rows = 0
        self._matcher = SuffixMatcher(max_ngram)  # a match `lookup_matches` found, `propose` finds kept

    def lookup_matches(self, batch: DraftBatch) -> list[int]:
        """The rows this step drafts by lookup: their suffix matches' lengths, at least min_match tokens."""
        matches = [self._matcher.match(seq_id, history) for seq_id, history in zip(batch.seq_ids, batch.tokens)]
        return [m.length if m is not None and m.length >= self.min_match else 0 for m in matches]

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        B = len(batch.seq_ids)
        matches = [self._matcher.match(seq_id, history) for seq_id, history in zip(batch.seq_ids, batch.tokens)]
        lookup = {row: m.continuation(history, K) for row, (m, history) in enumerate(zip(matches, batch.tokens))
                  if m is not None and m.length >= self.min_match}
        model_rows = [row for row in range(B) if row not in lookup]
        self.lookup_rows += len(lookup)
        self.model_rows += len(model_rows)
        if not lookup:
            return self.model.propose(batch, K)
        device = batch.anchor_tokens.device
        # Drafts each row verifies: K, or 2m+1 for trimmed lookup rows; the model's choice for its rows.
        num_drafts = [min(K, 2 * matches[row].length + 1) if self.trim_lookup and row in lookup else K
                      for row in range(B)]
        lookup_index = torch.tensor(list(lookup), dtype=torch.long, device=device)
        lookup_tokens = torch.tensor(list(lookup.values()), dtype=torch.long, device=device)  # (B_l, K)
        # (B, K, V) the rows' distributions, None while all are one-hot (lookup's, greedy rows': `Proposal.draft_probs`)
        probs: torch.Tensor | None = None
        if not model_rows:  # every row looked up; `lookup` holds them in row order
            tokens = lookup_tokens
        else:
            drafted = self.model.propose(batch.select(model_rows), K)
            tokens = torch.empty((B, K), dtype=torch.long, device=device)  # (B, K)
            index = torch.tensor(model_rows, dtype=torch.long, device=device)
            tokens[index] = drafted.draft_tokens
            tokens[lookup_index] = lookup_tokens
            if drafted.draft_probs is not None:
                probs = torch.empty((B, K, self.vocab_size), dtype=drafted.draft_probs.dtype, device=device)
                probs[index] = drafted.draft_probs
                probs[lookup_index] = one_hot_probs(lookup_tokens, self.vocab_size).to(probs.dtype)
            if drafted.num_drafts is not None:
                for row, n in zip(model_rows, drafted.num_drafts.tolist()):
                    num_drafts[row] = n
        stops = any(n < K for n in num_drafts)
        match_length = torch.tensor([matches[row].length if row in lookup else 0 for row in range(B)], device=device)
        return Proposal(tokens, probs, torch.tensor(num_drafts, dtype=torch.long, device=device) if stops else None,
                        self._confidence(B, K, lookup_index, model_rows, drafted if model_rows else None, device),
                        match_length)

    @staticmethod
    def _confidence(B: int, K: int, lookup_index: torch.Tensor, model_rows: list[int], drafted: Proposal | None,
                    device: torch.device) -> torch.Tensor | None:
        """(B, K): the model's confidence on its rows and NaN on lookup rows, which drafted without a model's
        distribution (`KIND+ngram:auto` then judges them by their own record); None if the model reports none."""
        if drafted is not None and drafted.confidence is None:
            return None
        confidence = torch.full((B, K), float("nan"), device=device)
        if drafted is not None:
            confidence[torch.tensor(model_rows, dtype=torch.long, device=device)] = drafted.confidence.float()
        return confidence

    def release(self, seq_id: int) -> None:
        self._matcher.release(seq_id)
        super().release(seq_id)

    def lookup_share(self) -> float:
        """Fraction of row-steps drafted by lookup so far (0 before any proposal)."""
        total = self.lookup_rows + self.model_rows
        return self.lookup_rows / total if total else 0.0

