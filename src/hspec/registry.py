"""A tiny registry of drafter kinds; each kind registers its class with a decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry:
    """Maps a kind name to a class. Instances, not module globals, hold the entries."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorator(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = cls
            cls.kind = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def get(self, name: str) -> type:
        if name not in self._entries:
            raise ValueError(f"unknown {self.what} {name!r}; allowed: {sorted(self._entries)}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
