"""Drafter kinds. Importing this package registers every kind in `DRAFTERS`."""

from hspec.drafters import dels, dflash, dflash2, dfly, hspec, ngram, peagle, plain, specblock  # noqa: F401  (registration side effect)
from hspec.drafters.base import (
    DRAFTERS,
    DraftBatch,
    Drafter,
    Proposal,
    create_drafter,
    drafter_config,
    vllm_exported_kinds,
)
from hspec.drafters.plain import PLAIN

__all__ = ["DRAFTERS", "PLAIN", "DraftBatch", "Drafter", "Proposal", "create_drafter", "drafter_config",
           "vllm_exported_kinds"]
