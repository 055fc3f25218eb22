"""Vocabulary pruning: the drafter predicts only the most frequent target tokens of its corpus."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def most_frequent_tokens(sequences: Iterable[Sequence[int]], vocab_size: int, keep: int = 32000) -> torch.Tensor:
    """The `keep` most frequent ids over `sequences` (ties and unseen ids by id), sorted ascending, (Vp,).

    If the target's vocabulary is smaller than `keep`, every id is kept.
    """
    keep = min(keep, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(list(seq), dtype=torch.long), minlength=vocab_size)
    # Stable descending sort: among equal counts the smaller id wins, so the result is deterministic.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:keep]).values
