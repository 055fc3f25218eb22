"""The drafter names the command line takes: `KIND`, `KIND+ngram`, `KIND:P`, `KIND:auto` and their mixes.

- `KIND`: a registered drafter kind (`hspec`, `dspark`, `ngram`, `none`, ...);
- `KIND+ngram`: prompt lookup in front of trained KIND (`hspec.drafters.lookup_first`);
- `KIND:P`: KIND's drafts verified only while its confidence is at least P, 0 < P < 1
  (`hspec.drafters.early_stop`); `KIND+ngram:P` does both, and a lookup row then verifies 2m+1
  drafts after an m-token match;
- `KIND:auto` (and `KIND+ngram:auto`, `ngram:auto`): each row verifies the number of drafts, 0 included,
  that pays most per step cost on this machine, and backs off drafting where it does not pay
  (`hspec.drafters.cost_aware`); drafts without a confidence (lookup, n-gram) are judged by the row's record;
- `KIND:tree`: a block drafter's candidates as a token tree per greedy row, grown while it pays per step
  cost (`hspec.drafters.block_tree`).

This module only reads the name; `hspec.runtime.build_drafter` builds what it describes, and tests
that build their own variants read names with the same `parse_drafter_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hspec.drafters.block_tree import TREE
from hspec.drafters.cost_aware import ADAPTIVE_LENGTH
from hspec.drafters.early_stop import CONFIDENCE_SEPARATOR
from hspec.drafters.lookup_first import LOOKUP_SUFFIX

# Kinds that carry no trained model, so nothing can sit behind lookup or report a confidence.
MODEL_FREE = ("none", "ngram")


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter name. `base` is the kind that drafts when lookup does not (not checked
    against the registry here, so tests can name their own drafters)."""

    base: str  # the drafter kind, e.g. "hspec"
    lookup: bool = False  # `+ngram`: prompt lookup first, `base` for rows without a match
    confidence_floor: float | None = None  # `:P`: verify only leading drafts of confidence >= P
    adaptive_length: bool = False  # `:auto`: the draft length that pays most per step (cost_aware.py)
    tree: bool = False  # `:tree`: a token tree per greedy row, grown while it pays (block_tree.py)

    @property
    def wrapped(self) -> bool:
        """Whether the name asks for more than the bare kind."""
        return self.lookup or self.confidence_floor is not None or self.adaptive_length or self.tree


def parse_drafter_spec(text: str) -> DrafterSpec:
    """`KIND[+ngram][:P|:auto]` or `KIND:tree` -> DrafterSpec; ValueError naming the bad part and what is allowed."""
    spec, separator, floor_text = text.partition(CONFIDENCE_SEPARATOR)
    adaptive, tree = floor_text == ADAPTIVE_LENGTH, floor_text == TREE
    floor = _confidence_floor(floor_text, text) if separator and not (adaptive or tree) else None
    base = spec.removesuffix(LOOKUP_SUFFIX)
    lookup = base != spec
    if tree and (lookup or base in MODEL_FREE):
        raise ValueError(f"{text!r}: {CONFIDENCE_SEPARATOR}{TREE} grows a tree from a trained block drafter's "
                         f"distributions, alone: use e.g. hspec{CONFIDENCE_SEPARATOR}{TREE}")
    if adaptive and base == "none":
        raise ValueError(f"{text!r}: plain decoding drafts nothing, so it has no draft length to choose")
    if floor is not None and base in MODEL_FREE:
        suffix = f"{CONFIDENCE_SEPARATOR}{floor_text}"
        raise ValueError(f"{text!r}: only trained drafters report the confidence that {suffix} reads; use e.g. "
                         f"hspec{suffix} or hspec{LOOKUP_SUFFIX}{suffix}")
    if lookup and base in MODEL_FREE:
        raise ValueError(f"{text!r}: put prompt lookup in front of a trained drafter kind, e.g. hspec{LOOKUP_SUFFIX}")
    return DrafterSpec(base, lookup, floor, adaptive, tree)


def _confidence_floor(text: str, name: str) -> float:
    """The P of `KIND:P`, a number in (0, 1)."""
    try:
        floor = float(text)
    except ValueError:
        floor = float("nan")
    if not 0.0 < floor < 1.0:
        raise ValueError(f"{name!r}: after {CONFIDENCE_SEPARATOR!r} comes a confidence floor, a number in (0, 1) "
                         f"(e.g. hspec{LOOKUP_SUFFIX}{CONFIDENCE_SEPARATOR}0.4), {ADAPTIVE_LENGTH!r} for the "
                         f"cost-aware draft length (e.g. hspec{CONFIDENCE_SEPARATOR}{ADAPTIVE_LENGTH}), or "
                         f"{TREE!r} for a cost-aware token tree (e.g. hspec{CONFIDENCE_SEPARATOR}{TREE}); got {text!r}")
    return floor
