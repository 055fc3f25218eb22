"""A drafter built around another: it changes how `model` proposes and leaves everything else to it.

`KIND:P` (`early_stop.py`) cuts a model's proposals after its confident drafts, `KIND+ngram`
(`lookup_first.py`) drafts by prompt lookup where it can and asks the model otherwise. Both keep the
model's target layers and drafter KV layers and pass it every commit, release and carried state, so the
model's per-sequence state stays current whichever of them drafted a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DraftBatch, Drafter
from hspec.models.config import TargetConfig


class WrappingDrafter(Drafter):
    """`model`'s target layers, drafter layers and per-sequence state; subclasses define `propose`."""

    needs_target_model = True

    def __init__(self, model: Drafter) -> None:
        self.model = model
        self.target_layers = model.target_layers
        self.num_drafter_layers = model.num_drafter_layers

    def check_target(self, config: TargetConfig) -> None:
        self.model.check_target(config)

    def lookup_matches(self, batch: DraftBatch) -> list[int]:
        return self.model.lookup_matches(batch)

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        self.model.commit(pool, seq_ids, hidden, num_committed)

    def release(self, seq_id: int) -> None:
        self.model.release(seq_id)

    def carried_state(self, seq_id: int) -> object | None:
        return self.model.carried_state(seq_id)

    def restore_carried_state(self, seq_id: int, state: object | None) -> None:
        self.model.restore_carried_state(seq_id, state)
