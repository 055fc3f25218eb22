"""A tiny registry of drafter kinds; each kind registers its class with a decorator."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


class Registry:
    """Maps a kind name to a class. Instances, not module globals, hold the entries.

    A class may answer to several names: its own (`cls.kind`) and its presets (`cls.presets`), named
    configurations of the same class (H-Spec's ablations); an instance of a preset then takes its kind from
    its configuration.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, type] = {}

    def register(self, name: str, presets: Iterable[str] = ()) -> Callable[[type[T]], type[T]]:
        """Register the decorated class as `name` and as each of `presets`."""
        presets = tuple(presets)

        def decorator(cls: type[T]) -> type[T]:
            for each in (name, *presets):
                if each in self._entries:
                    raise ValueError(f"{self.what} {each!r} is registered twice")
            for each in (name, *presets):
                self._entries[each] = cls
            cls.kind = name  # type: ignore[attr-defined]
            cls.presets = presets  # type: ignore[attr-defined]
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
