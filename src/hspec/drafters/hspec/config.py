"""Configuration of the H-Spec drafter and its ablations, presets of it (paper §3.3, §4.3, App. B.1, B.4).

A drafter is a stack of layers, each a residual sequence of pre-norm modules named in `layers`:
"mamba-attention-mlp" (a full H-Spec layer), "mamba-mlp" (the partial layer; Mamba-only) and
"attention-mlp" (Attention-only). The i-th attention module reads the K/V of the i-th of the last
n_attn selected target layers, so H-Spec's 3 attention modules read the last 3 (paper B.1).

Mamba head count: the paper fixes headdim 64 and picks `nheads` per target so H-Spec's trainable
parameters are within 3% of DSpark's (44 / 48 / 56 heads for Qwen3-4B / Qwen3-8B / Llama-3.1-8B).
`choose_mamba_heads` makes that choice by rule: the smallest nheads (a multiple of ngroups) whose
count is within the tolerance, which reproduces the paper's three numbers. A target too small for
64-wide heads (4 heads would overshoot) halves headdim until a count fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.common import DrafterConfig, dspark_trainable_params, markov_params
from hspec.models.config import TargetConfig
from hspec.ssm.mixer import Mamba2Config, count_mixer_params

FULL = "mamba-attention-mlp"
PARTIAL = "mamba-mlp"
ATTENTION_MLP = "attention-mlp"
LAYER_KINDS = (FULL, PARTIAL, ATTENTION_MLP)

HSPEC = "hspec"  # the kind's name (drafters/hspec/model.py registers it with its presets)
# The ablations, presets of the hspec kind: preset name -> the HSpecConfig fields it sets over H-Spec's own. Each
# is a kind name wherever one is typed (`--drafter`, checkpoints' `speculators_model_type`, evaluation labels) and
# builds the same class; the module dimensions stay H-Spec's (paper B.4).
PRESETS: dict[str, dict[str, Any]] = {
    # paper §4.3 target-context ablations: same architecture, one context source removed.
    "hspec-lasttoken-only": {"attend_target": False},  # attention sees the block only
    "hspec-kvreuse-only": {"inject_state": False},  # S_init = 0, no fusion weights
    # paper §4.3 / App. B.4 architecture ablations: no Markov head. "Hybrid" is H-Spec's backbone alone.
    "hspec-nomarkov": {"markov_rank": 0},
    "mamba-only": {"layers": (PARTIAL,) * 5, "markov_rank": 0},
    "attention-only": {"layers": (ATTENTION_MLP,) * 5, "markov_rank": 0, "inject_state": False},
}


@dataclass(frozen=True)
class HSpecConfig(DrafterConfig):
    """H-Spec sizes; target dimensions, target layers and vocabulary come from `DrafterConfig`."""

    layers: tuple[str, ...] = (FULL, FULL, FULL, PARTIAL)  # module layout of each drafter layer
    inject_state: bool = True  # S_init = Proj_dS(Proj_r(concat(h))); False: S_init = 0, no fusion weights
    attend_target: bool = True  # attention reads the target's K/V; False: the block only
    fusion_rank: int = 0  # r of Proj_r (paper: r = H); 0 only when nothing is injected
    mamba_nheads: int = 4  # Mamba-2 heads (paper: 44 / 48 / 56)
    mamba_headdim: int = 64  # P
    mamba_d_state: int = 4  # N
    mamba_ngroups: int = 4  # B/C groups
    mamba_d_conv: int = 4  # causal conv kernel
    mamba_expand: int = 1  # recorded for the paper's table; d_inner = nheads * headdim

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [layer for layer in self.layers if layer not in LAYER_KINDS]
        if not self.layers or bad:
            raise ValueError(f"layers must be a non-empty tuple of {LAYER_KINDS}, got {self.layers}")
        if self.num_attention > len(self.target_layers):
            raise ValueError(f"{self.num_attention} attention modules need as many selected target layers, "
                             f"got target_layers={self.target_layers}")
        if self.injects and self.fusion_rank < 1:
            raise ValueError(f"fusion_rank must be >= 1 when the state is injected, got {self.fusion_rank}")
        if self.num_mamba:
            self.mamba_config()  # validates the Mamba sizes (nheads divisible by ngroups, ...)

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> HSpecConfig:
        """`kind`'s configuration for `target` (hspec or a preset): r = H, Mamba heads matched to DSpark, the
        preset's fields, then `overrides`."""
        if kind != HSPEC and kind not in PRESETS:
            raise ValueError(f"unknown H-Spec kind {kind!r}; allowed: {[HSPEC, *sorted(PRESETS)]}")
        base: dict[str, Any] = {"fusion_rank": target.hidden_size}
        sized = {k: v for k, v in overrides.items() if k in ("target_layers", "draft_vocab_size", "markov_rank")}
        nheads, headdim = choose_mamba_heads(target, **sized)
        base.update(mamba_nheads=nheads, mamba_headdim=headdim)
        base.update(PRESETS.get(kind, {}))
        base.update(overrides)
        return super().from_target(kind, target, **base)  # type: ignore[return-value]

    @property
    def num_attention(self) -> int:
        return sum("attention" in layer for layer in self.layers)

    @property
    def num_mamba(self) -> int:
        return sum("mamba" in layer for layer in self.layers)

    @property
    def injects(self) -> bool:
        """Whether S_init is projected from the target's hidden states (else the scans start at 0)."""
        return self.inject_state and self.num_mamba > 0

    @property
    def attention_source_layers(self) -> tuple[int, ...]:
        """HF hidden-state index whose K/V each attention module reads: the last n_attn selected."""
        return self.target_layers[len(self.target_layers) - self.num_attention:]

    @property
    def state_size(self) -> int:
        """d_S = nheads * headdim * d_state, the flattened Mamba-2 state S_init is projected to."""
        return self.mamba_nheads * self.mamba_headdim * self.mamba_d_state

    def mamba_config(self) -> Mamba2Config:
        return Mamba2Config(d_model=self.hidden_size, nheads=self.mamba_nheads, headdim=self.mamba_headdim,
                            d_state=self.mamba_d_state, ngroups=self.mamba_ngroups, d_conv=self.mamba_d_conv,
                            expand=self.mamba_expand)


def hspec_trainable_params(config: HSpecConfig) -> int:
    """Trainable parameters of `HSpecDrafter(config)`, by formula (the target's parts are frozen)."""
    H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    mamba = H + count_mixer_params(H, config.mamba_nheads, config.mamba_headdim, config.mamba_d_state,
                                   config.mamba_ngroups, config.mamba_d_conv)
    attention = H + H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 2 * D
    mlp = H + 3 * H * config.intermediate_size
    total = H + H  # learned MASK embedding + final RMSNorm
    for layer in config.layers:
        total += mlp + ("mamba" in layer) * mamba + ("attention" in layer) * attention
    if config.injects:
        total += len(config.target_layers) * H * config.fusion_rank + config.fusion_rank * config.state_size
    return total + markov_params(config)


def choose_mamba_heads(target: TargetConfig, tolerance: float = 0.03, **fields: Any) -> tuple[int, int]:
    """(nheads, headdim) for H-Spec on `target`: the smallest nheads (multiple of ngroups = 4) whose
    trainable count is within `tolerance` of DSpark's; headdim 64, halved while no nheads fits.

    `fields` (target_layers, draft_vocab_size, markov_rank) override the defaults on both sides.
    Falls back to the closest count at headdim 8 if nothing is within tolerance.
    """
    base = DrafterConfig.from_target("dspark", target, **fields)
    budget = dspark_trainable_params(base)
    common = dict(kind=HSPEC, target=target, target_layers=base.target_layers,
                  draft_vocab_size=base.draft_vocab_size, markov_rank=base.markov_rank,
                  fusion_rank=target.hidden_size)
    best: tuple[float, int, int] | None = None
    for headdim in (64, 32, 16, 8):
        for nheads in range(4, 4 * 1024 + 1, 4):
            count = hspec_trainable_params(HSpecConfig(**common, mamba_nheads=nheads, mamba_headdim=headdim))
            gap = abs(count - budget) / budget
            if best is None or gap < best[0]:
                best = (gap, nheads, headdim)
            if gap <= tolerance:
                return nheads, headdim
            if count > budget:
                break
    assert best is not None
    return best[1], best[2]

