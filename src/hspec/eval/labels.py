"""The label of one draft length of a sweep: `hspec eval --k 3,5,7` runs drafter LABEL as "LABEL k=3", ...

The one writer (`sweep_label`) and reader (`split_sweep_label`) of that form, for the runner, its tables
and plots, the claims and `hspec lab table`.
"""

from __future__ import annotations

SEPARATOR = " k="


def sweep_label(label: str, k: int) -> str:
    """"hspec", 5 -> "hspec k=5"."""
    return f"{label}{SEPARATOR}{k}"


def split_sweep_label(label: str) -> tuple[str, int | None]:
    """"hspec k=5" -> ("hspec", 5); a label of no sweep -> (label, None)."""
    base, sep, k = label.rpartition(SEPARATOR)
    return (base, int(k)) if sep and k.isdigit() else (label, None)
