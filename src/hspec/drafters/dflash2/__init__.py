"""DFlash-2 (z-lab): kind `dflash2` (registered on import)."""

from hspec.drafters.dflash2.config import DFlash2Config, dflash2_trainable_params
from hspec.drafters.dflash2.model import DFlash2Drafter, DFlash2Layer, PathSelector, two_tap_conv

__all__ = ["DFlash2Config", "DFlash2Drafter", "DFlash2Layer", "PathSelector", "dflash2_trainable_params",
           "two_tap_conv"]
