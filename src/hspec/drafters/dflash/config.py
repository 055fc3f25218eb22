"""Configuration of the DFlash-family baselines (docs/design.md#dflash-family, paper §3.1, App. B.2).

Three kinds share one backbone: 5 Qwen3-style layers (pre-norm attention with per-head q/k-norm,
then a SwiGLU MLP) with the target's attention (Hq, Hkv, D) and MLP (I) dimensions, a bidirectional
block over [context ; block] keys, and the target's frozen embedding and (pruned) LM head.

- `dflash`: each committed position t contributes c_t = RMSNorm(W_fc · concat_5(h_t)); layer i
  projects c_t with its own W_k/W_v into a drafter-side KV cache kept in the pool's drafter layers.
- `dspark`: DFlash + the DSpark Markov head (rank 256).
- `dflash-kvreuse` (paper §3.1): layer i attends to the K/V of the i-th selected target layer in
  place; no fusion and no drafter-side KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.common import DrafterConfig, markov_params
from hspec.models.config import TargetConfig

# kind -> how it differs from the plain DFlash defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "dflash": {"markov_rank": 0},
    "dspark": {"markov_rank": 256},
    "dflash-kvreuse": {"markov_rank": 0, "reuse_target_kv": True},
}


@dataclass(frozen=True)
class DFlashConfig(DrafterConfig):
    """DFlash sizes; target dimensions, target layers and vocabulary come from `DrafterConfig`."""

    num_layers: int = 5  # drafter layers (official DFlash/DSpark checkpoints: 5, paper B.1)
    reuse_target_kv: bool = False  # True: layer i reads target layer target_layers[i]'s K/V, no fusion

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.reuse_target_kv and self.num_layers != len(self.target_layers):
            raise ValueError(f"target-KV reuse maps drafter layer i to selected target layer i: num_layers "
                             f"({self.num_layers}) must equal len(target_layers) ({len(self.target_layers)})")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> DFlashConfig:
        """`kind`'s configuration for `target`, then `overrides`."""
        if kind not in VARIANTS:
            raise ValueError(f"unknown DFlash variant {kind!r}; allowed: {sorted(VARIANTS)}")
        return super().from_target(kind, target, **{**VARIANTS[kind], **overrides})  # type: ignore[return-value]


def dflash_trainable_params(config: DFlashConfig) -> int:
    """Trainable parameters of a DFlash-family drafter for `config`, by formula.

    Per layer: q/k/v/o with the target's (Hq, Hkv, D), q/k-norm (2D), SwiGLU (3HI), 2 RMSNorms. Plus,
    unless the target's K/V are reused, W_fc (n_sel*H -> H) and its RMSNorm; the final RMSNorm, the
    learned MASK embedding and the Markov head. Equals `dspark_trainable_params` for `dspark`.
    """
    H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    layer = H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 2 * D + 3 * H * config.intermediate_size + 2 * H
    fusion = 0 if config.reuse_target_kv else len(config.target_layers) * H * H + H
    return config.num_layers * layer + fusion + 2 * H + markov_params(config)
