"""Prompt-lookup (n-gram) drafting: copy what followed the last occurrence of the latest n-gram."""

from hspec.drafters.ngram.drafter import NgramDrafter

__all__ = ["NgramDrafter"]
