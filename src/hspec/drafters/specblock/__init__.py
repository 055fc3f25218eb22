"""SpecBlock (arXiv 2605.07243, abstract only): kind `specblock` (registered on import)."""

from hspec.drafters.specblock.config import SpecBlockConfig, specblock_trainable_params
from hspec.drafters.specblock.model import SpecBlockDrafter
from hspec.drafters.specblock.tree_shape import tree_branching

__all__ = ["SpecBlockConfig", "SpecBlockDrafter", "specblock_trainable_params", "tree_branching"]
