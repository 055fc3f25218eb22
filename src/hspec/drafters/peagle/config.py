"""Configuration of the P-Eagle baseline (docs/design.md#p-eagle; Hui et al., 2026).

P-Eagle is EAGLE-3 turned into a parallel drafter: one forward predicts every depth d = 0..K-1 of
the draft. Its first layer is EAGLE-3's fused layer (attention over [embedding ; projected target
feature], 2H wide), followed by plain Qwen3-style layers; all attention is causal. Dimensions are the
target's (Hq, Hkv, D, I) as for every baseline (paper B.2), the context is the same 5 selected target
layers (W_fc: 5H -> H), and the drafter keeps a KV cache over the context in the pool's drafter layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.common import DrafterConfig, markov_params
from hspec.models.config import TargetConfig


@dataclass(frozen=True)
class PEagleConfig(DrafterConfig):
    """P-Eagle sizes; target dimensions, target layers and vocabulary come from `DrafterConfig`."""

    num_layers: int = 4  # drafter layers, the first one fused (speculators' P-EAGLE default: 4)
    cod_ratio: float = 0.6  # COD sampling in training: depth d keeps max(ratio^d, cod_min) of anchors
    cod_min: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 < self.cod_min <= 1 or not 0 < self.cod_ratio <= 1:
            raise ValueError(f"cod_ratio and cod_min must be in (0, 1], got {self.cod_ratio} and {self.cod_min}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> PEagleConfig:
        """P-Eagle for `target`: no Markov head (it is not part of P-Eagle), then `overrides`."""
        return super().from_target(kind, target, **{"markov_rank": 0, **overrides})  # type: ignore[return-value]

    def cod_keep_fraction(self, depth: int) -> float:
        """Share of anchors whose depth-`depth` prediction is trained (COD sampling, paper B.3)."""
        return max(self.cod_ratio**depth, self.cod_min)


def peagle_trainable_params(config: PEagleConfig) -> int:
    """Trainable parameters of `PEagleDrafter(config)`, by formula.

    Fused first layer: q/k/v from 2H, o, q/k-norm, input/hidden/post-attention norms, SwiGLU. Other
    layers: q/k/v/o from H, q/k-norm, 2 norms, SwiGLU. Plus W_fc (n_sel*H -> H), the shared hidden
    vector (n_sel*H), the MASK embedding, the final norm and a Markov head if configured.
    """
    H, Hq, Hkv, D, n_sel = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, len(
        config.target_layers)
    mlp = 3 * H * config.intermediate_size

    def attention(d_in: int) -> int:
        return d_in * (Hq + 2 * Hkv) * D + Hq * D * H + 2 * D

    first = attention(2 * H) + 3 * H + mlp
    rest = (config.num_layers - 1) * (attention(H) + 2 * H + mlp)
    return first + rest + n_sel * H * H + n_sel * H + 2 * H + markov_params(config)
