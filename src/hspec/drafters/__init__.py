"""Drafter kinds. Importing this package registers every kind in `DRAFTERS`."""

from hspec.drafters import dflash, hspec, ngram, peagle, plain  # noqa: F401  (registration side effect)
from hspec.drafters.base import DRAFTERS, DraftBatch, Drafter, Proposal, create_drafter, drafter_config

__all__ = ["DRAFTERS", "DraftBatch", "Drafter", "Proposal", "create_drafter", "drafter_config"]
