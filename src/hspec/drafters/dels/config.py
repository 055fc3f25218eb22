"""Configuration of DeLS-Spec (arXiv 2607.07409; no official code: speculators RFC #782, PRs #764 /
#783, branch `feat/dels_spec`).

DeLS-Spec keeps a DFlash drafter frozen and adds a local sequential head: a GRU over the target's
frozen embeddings of the previous tokens, projected through rank r to the draft vocabulary. At
inference the two are fused per slot,

    l_k = l_dflash,k + alpha * l_local,k - beta * l_prior,

with l_prior the unigram log-prior of the draft vocabulary (alpha = beta = 0.3 in the PR). The local
head is trained with plain next-token prediction and needs no target hidden states.

What hspec had to choose (the sources do not say): the GRU reads the `local_window` tokens before
the anchor x0 and then x0 and the drafts, restarting every block (it keeps no state per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.dflash.config import DFlashConfig, dflash_trainable_params
from hspec.models.config import TargetConfig


@dataclass(frozen=True)
class DeLSConfig(DFlashConfig):
    """DFlash sizes plus the local head's and the fusion's."""

    local_hidden: int = 1024  # GRU hidden width (the PR: 1024)
    local_rank: int = 256  # r of the projection GRU state -> r -> Vp
    local_window: int = 16  # tokens before x0 the GRU reads (hspec's choice)
    fusion_alpha: float = 0.3  # alpha: weight of l_local
    fusion_beta: float = 0.3  # beta: weight of the subtracted unigram log-prior
    freeze_dflash: bool = True  # train only the local head (DeLS-Spec's recipe)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reuse_target_kv:
            raise ValueError("dels fuses a DFlash drafter with its own context KV; reuse_target_kv must be False")
        for name in ("local_hidden", "local_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.local_window < 0:
            raise ValueError(f"local_window must be >= 0, got {self.local_window}")
        if self.fusion_alpha < 0 or self.fusion_beta < 0:
            raise ValueError(f"fusion_alpha and fusion_beta must be >= 0, got {self.fusion_alpha} and "
                             f"{self.fusion_beta}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> DeLSConfig:
        """DeLS-Spec for `target`: a plain DFlash (no Markov head) plus the local head, then `overrides`."""
        # DrafterConfig's defaults directly: DFlashConfig.from_target only knows its own variants.
        config = super(DFlashConfig, cls).from_target(kind, target, **{"markov_rank": 0, **overrides})
        return config  # type: ignore[return-value]


def dels_trainable_params(config: DeLSConfig) -> int:
    """Trainable parameters of `DeLSDrafter(config)`: the local head only when DFlash is frozen.

    GRU (3 gates: input H -> Hg and hidden Hg -> Hg with two biases each), then Hg -> r and r -> Vp.
    """
    H, Hg, r = config.hidden_size, config.local_hidden, config.local_rank
    local = 3 * (H * Hg + Hg * Hg + 2 * Hg) + Hg * r + r * config.draft_vocab_size
    return local if config.freeze_dflash else local + dflash_trainable_params(config)
