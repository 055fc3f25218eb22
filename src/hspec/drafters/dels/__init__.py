"""DeLS-Spec (arXiv 2607.07409): kind `dels` (registered on import)."""

from hspec.drafters.dels.config import DeLSConfig, dels_trainable_params
from hspec.drafters.dels.model import DeLSDrafter, LocalHead

__all__ = ["DeLSConfig", "DeLSDrafter", "LocalHead", "dels_trainable_params"]
