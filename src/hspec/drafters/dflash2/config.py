"""Configuration of DFlash-2 (z-lab blog "dflash2"; public code: z-lab/dflash, speculators branch
`dflash2`, SpecForge PR #772, vLLM PR #52816).

DFlash-2 is DFlash (5 Qwen3-style layers over a drafter-side context KV cache) with two additions:

- a two-tap dynamic depthwise convolution before and after every attention and MLP sublayer:
  out[i, c] = sum_{t in {0, 1}} (base[t, c] + delta[i, t, g(c)]) * x[i - t, c], where delta comes
  from one linear projection of the sublayer's input per G = H / group channel groups, the taps are
  zero across the block boundary (slot 0 has no slot before it), and the pre- and post-sublayer
  convolutions share the projection but have their own `base`; initialised to the identity;
- a path selector: per slot t, keep the top-C candidates of the backbone logits U_t and score a
  candidate b after the previous token a by S_t(a, b) = U_t(b) + <A[a] * (W h_t), B[b]> with
  codebooks A, B (rank r) and W: H -> r; drafting walks the slots from the anchor, greedily at
  T = 0 and by inverse-CDF sampling at T > 0, and returns q over the candidates as the draft
  distribution, so verification stays exact.

Training: the backbone keeps the unified loss on U; the selector adds `selector_loss_weight` x a
C-way cross-entropy over the candidates (the gold token put in place of the last candidate when
it is not among them), weighted by position like the unified loss. U is detached in it; the query
W h_t is not, unless `selector_trains_backbone` is False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspec.drafters.dflash.config import DFlashConfig, dflash_trainable_params
from hspec.models.config import TargetConfig


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """DFlash sizes plus the convolutions' grouping and the path selector's sizes."""

    conv_group_size: int = 16  # channels per group sharing one dynamic delta (16 in the release)
    selector_candidates: int = 16  # C: candidates kept per slot (top-16 in the release)
    selector_rank: int = 256  # r: width of the codebooks A, B and of W h_t
    selector_loss_weight: float = 1.0  # alpha: weight of the selector's C-way cross-entropy
    # Whether the selector's loss reaches the backbone through its query W h_t (the recipe); False detaches
    # h_t there, a diagnostic of whether that gradient is what holds the backbone back (docs/drafters.md).
    selector_trains_backbone: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reuse_target_kv:
            raise ValueError("dflash2 keeps its own context KV like DFlash; reuse_target_kv must be False")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size must be >= 1 and divide the hidden size {self.hidden_size}, "
                             f"got {self.conv_group_size}")
        if not 1 <= self.selector_candidates <= self.draft_vocab_size:
            raise ValueError(f"selector_candidates must be in 1..{self.draft_vocab_size} (the draft vocabulary), "
                             f"got {self.selector_candidates}")
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> DFlash2Config:
        """DFlash-2 for `target`: DFlash's defaults without a Markov head (the selector replaces it),
        at most 16 candidates and no more than the draft vocabulary holds, then `overrides`."""
        vocab = overrides.get("draft_vocab_size", min(32000, target.vocab_size))
        defaults = {"markov_rank": 0, "selector_candidates": min(16, vocab)}
        # DrafterConfig's defaults directly: DFlashConfig.from_target only knows its own variants.
        config = super(DFlashConfig, cls).from_target(kind, target, **{**defaults, **overrides})
        return config  # type: ignore[return-value]

    @property
    def conv_groups(self) -> int:
        """G = H / conv_group_size."""
        return self.hidden_size // self.conv_group_size


def dflash2_trainable_params(config: DFlash2Config) -> int:
    """Trainable parameters of `DFlash2Drafter(config)`, by formula.

    DFlash's, plus per layer and sublayer (attention, MLP) the delta projection H -> 2G and two bases
    (2 x 2H), plus the selector: W (H x r) and the codebooks A, B (V x r each).
    """
    H, G, r = config.hidden_size, config.conv_groups, config.selector_rank
    convs = config.num_layers * 2 * (H * 2 * G + 2 * 2 * H)
    return dflash_trainable_params(config) + convs + H * r + 2 * config.vocab_size * r
