"""DFly (AngelSpec): kind `dfly` (registered on import)."""

from hspec.drafters.dfly.config import DFlyConfig, dfly_trainable_params
from hspec.drafters.dfly.model import DFlyDrafter, PrevTokenCorrection

__all__ = ["DFlyConfig", "DFlyDrafter", "PrevTokenCorrection", "dfly_trainable_params"]
