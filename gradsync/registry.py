"""A small name -> object registry shared by topologies, synthesizers and (later) compressors.

Everything a user can name comes from a registry, so the CLI can list the choices and an unknown
name fails with the list of known ones instead of a ``KeyError``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from gradsync.errors import GradsyncError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names (and aliases) to entries; ``get`` explains unknown names."""

    def __init__(self, what: str, error: type[GradsyncError] = GradsyncError) -> None:
        self.what = what
        self._error = error
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def add(self, name: str, entry: T, *, aliases: tuple[str, ...] = ()) -> T:
        for key in (name, *aliases):
            if key in self._entries or key in self._aliases:
                raise ValueError(f"{self.what} {key!r} is registered twice")
        self._entries[name] = entry
        for alias in aliases:
            self._aliases[alias] = name
        return entry

    def register(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(entry: T) -> T:
            return self.add(name, entry, aliases=aliases)

        return deco

    def canonical(self, name: str) -> str:
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        known = ", ".join(self.names())
        close = difflib.get_close_matches(name, [*self._entries, *self._aliases], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise self._error(f"unknown {self.what} {name!r}; known: {known}.{hint}")

    def get(self, name: str) -> T:
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        return list(self._entries)

    def aliases_of(self, name: str) -> list[str]:
        return [a for a, n in self._aliases.items() if n == name]

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __len__(self) -> int:
        return len(self._entries)
