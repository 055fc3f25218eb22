"""Configuration of DFly (AngelSpec, arXiv 2607.25852; public code: Tencent/AngelSpec `dfly.py`).

DFly is DFlash (5 Qwen3-style layers over a drafter-side context KV cache, the target's frozen
embedding and pruned LM head) with two changes:

- per-layer context: layer i reads c^i_t = RMSNorm(W_fc · concat(h_t) + sum_j softmax(alpha_i)_j h_{t,j}),
  DFlash's shared projection plus a learned convex mix of the tapped target layers, one mix per layer;
- a previous-token correction before the LM head, h' = h + SwiGLU([RMSNorm(h); RMSNorm(e_{prev})]),
  whose down-projection starts at zero (so an untrained correction is DFlash).

No Markov head: the correction is DFly's way of conditioning slot k on the draft before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.dflash.config import DFlashConfig
from hspec.models.config import TargetConfig


@dataclass(frozen=True)
class DFlyConfig(DFlashConfig):
    """DFlash sizes plus the correction's width."""

    correction_intermediate_size: int = 0  # SwiGLU width of the previous-token correction; 0 = H (AngelSpec's default)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reuse_target_kv:
            raise ValueError("dfly fuses the target layers into its own context KV; reuse_target_kv must be False")
        if self.correction_intermediate_size < 0:
            raise ValueError(f"correction_intermediate_size must be >= 0 (0 = H), got "
                             f"{self.correction_intermediate_size}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> DFlyConfig:
        """DFly for `target`: DFlash's defaults without a Markov head, then `overrides`."""
        # DrafterConfig's defaults directly: DFlashConfig.from_target only knows its own variants.
        config = super(DFlashConfig, cls).from_target(kind, target, **{"markov_rank": 0, **overrides})
        return config  # type: ignore[return-value]

    @property
    def correction_width(self) -> int:
        return self.correction_intermediate_size or self.hidden_size


def dfly_trainable_params(config: DFlyConfig) -> int:
    """Trainable parameters of `DFlyDrafter(config)`, by formula.

    DFlash's (layers, W_fc + its norm, final norm, MASK embedding) plus the per-layer fusion logits
    (num_layers x n_sel) and the correction: two norms (2H) and a SwiGLU 2H -> I_c -> H.
    """
    from hspec.drafters.dflash.config import dflash_trainable_params

    H, n_sel, inner = config.hidden_size, len(config.target_layers), config.correction_width
    return dflash_trainable_params(config) + config.num_layers * n_sel + 2 * H + 2 * (2 * H) * inner + inner * H
