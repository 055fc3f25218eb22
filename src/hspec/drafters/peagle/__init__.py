"""The P-Eagle baseline: kind `peagle` (registered on import)."""

from hspec.drafters.peagle.config import PEagleConfig, peagle_trainable_params
from hspec.drafters.peagle.model import PEagleDrafter

__all__ = ["PEagleConfig", "PEagleDrafter", "peagle_trainable_params"]
