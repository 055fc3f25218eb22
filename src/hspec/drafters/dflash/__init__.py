"""The DFlash-family baselines: `dflash`, `dspark`, `dflash-kvreuse` (registered on import)."""

from hspec.drafters.dflash.config import VARIANTS, DFlashConfig, dflash_trainable_params
from hspec.drafters.dflash.model import DFlashDrafter, DFlashKVReuse, DSparkDrafter

__all__ = ["VARIANTS", "DFlashConfig", "DFlashDrafter", "DFlashKVReuse", "DSparkDrafter", "dflash_trainable_params"]
