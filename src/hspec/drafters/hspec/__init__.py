"""The H-Spec drafter family: `hspec` and its ablations (registered on import)."""

from hspec.drafters.hspec.config import VARIANTS, HSpecConfig, choose_mamba_heads, hspec_trainable_params
from hspec.drafters.hspec.model import HSpecDrafter

__all__ = ["VARIANTS", "HSpecConfig", "HSpecDrafter", "choose_mamba_heads", "hspec_trainable_params"]
