"""The H-Spec drafter: `hspec` and its ablations, presets of it (registered on import)."""

from hspec.drafters.hspec.config import PRESETS, HSpecConfig, choose_mamba_heads, hspec_trainable_params
from hspec.drafters.hspec.model import HSpecDrafter

__all__ = ["PRESETS", "HSpecConfig", "HSpecDrafter", "choose_mamba_heads", "hspec_trainable_params"]
