"""Configuration of SpecBlock (arXiv 2605.07243). Only the abstract is public (no code, no equations):
docs/drafters.md#specblock-specblock-arxiv-260507243 lists which parts below come from it and which
choices are ours.

From the abstract: block-iterative tree drafting; a layer-wise shift that carries the previous
position's hidden state into every decoder layer; a new block that inherits hidden state from the
previous block; a co-trained rank head that sets the branching per position; a valid-prefix loss mask.

Ours: the backbone is DFlash's (5 layers over a drafter-side context KV cache, the target's frozen
embedding and pruned LM head, no Markov head); the shift is a zero-initialised linear map per layer
over the RMS-normalised previous input (so an untrained SpecBlock is DFlash); the rank head is a linear
classifier over the rank of the target's token among the drafter's candidates, and b_k is the smallest
branching whose predicted coverage reaches `rank_coverage`, cut to fit the row's node budget: `node_budget`,
or with `adapt_tree` (the abstract's "cost-aware" adaptation, ours in the details) the budget up to it that
maximises the tokens a step is expected to emit per unit of its cost (tree_shape.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.dflash.config import DFlashConfig
from hspec.models.config import TargetConfig


@dataclass(frozen=True)
class SpecBlockConfig(DFlashConfig):
    """DFlash sizes plus the tree's shape limits and the rank head's settings."""

    decoding_options = ("node_budget", "rank_coverage", "adapt_tree", "tree_cost_draft", "tree_cost_per_node",
                        "tree_cost_per_node_key")

    max_branch: int = 4  # b_max: most children per tree node; the rank head has b_max + 1 classes
    node_budget: int = 16  # most tree nodes one step verifies (the target scores node_budget + 1 tokens)
    rank_coverage: float = 0.8  # b_k = smallest b with P(rank of the target's token < b) >= this
    rank_loss_weight: float = 0.1  # weight of the rank head's cross-entropy beside the drafter loss
    # The cost-aware tree (tree_shape.py): each row's budget per step, <= node_budget, by expected tokens per
    # cost; False: node_budget always. The costs, in 1-token decodes, are this CPU's (2-core AVX-512 with AMX,
    # bf16 SmolLM2-135M): a 17-token tree's verify at 128 / 512 / 1,536 keys costs 1.32 / 1.60 / 2.27 decodes
    # (results/tree_verify/), 0.020 / 0.038 / 0.079 a node, whose least-squares line is 0.0152 + 4.2e-5 per key
    # (rounded here to 0.015 and 4e-5); SpecBlock's draft costs 0.23 of an 8-token verify at 256 keys
    # (results/draft_cost_kinds/), a verify that costs ~1.1 decodes: ~0.25 (tests/test_specblock.py checks both
    # against those files). On a GPU, where a verify of 17 tokens costs about one of 1, per-node costs near 0
    # give every row the full node_budget. To set them for another machine: docs/drafters.md (SpecBlock).
    adapt_tree: bool = True
    tree_cost_draft: float = 0.25
    tree_cost_per_node: float = 0.015
    tree_cost_per_node_key: float = 4e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reuse_target_kv:
            raise ValueError("specblock keeps its own context KV (the shift needs its own layers); "
                             "reuse_target_kv must be False")
        if self.markov_rank:
            raise ValueError(f"specblock drafts a tree whose nodes share a slot's distribution; markov_rank must "
                             f"be 0, got {self.markov_rank}")
        if self.max_branch < 1:
            raise ValueError(f"max_branch must be >= 1, got {self.max_branch}")
        if self.node_budget < 1:
            raise ValueError(f"node_budget must be >= 1, got {self.node_budget}")
        if not 0.0 < self.rank_coverage <= 1.0:
            raise ValueError(f"rank_coverage must be in (0, 1], got {self.rank_coverage}")
        for name in ("tree_cost_draft", "tree_cost_per_node", "tree_cost_per_node_key"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (a cost in 1-token decodes), got {getattr(self, name)}")
        if self.rank_loss_weight < 0:
            raise ValueError(f"rank_loss_weight must be >= 0, got {self.rank_loss_weight}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> SpecBlockConfig:
        """SpecBlock for `target`: DFlash's defaults without a Markov head, then `overrides`."""
        # DrafterConfig's defaults directly: DFlashConfig.from_target only knows its own variants.
        config = super(DFlashConfig, cls).from_target(kind, target, **{"markov_rank": 0, **overrides})
        return config  # type: ignore[return-value]


def specblock_trainable_params(config: SpecBlockConfig) -> int:
    """Trainable parameters of `SpecBlockDrafter(config)`, by formula: DFlash's, one H x H shift and its
    input's RMSNorm (H) per layer, and the rank head (H -> b_max + 1, with bias)."""
    from hspec.drafters.dflash.config import dflash_trainable_params

    H = config.hidden_size
    return dflash_trainable_params(config) + config.num_layers * (H * H + H) + (H + 1) * (config.max_branch + 1)
