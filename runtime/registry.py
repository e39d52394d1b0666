"""Named registries: one per extensible kind (advantage estimators, losses, filters, environments, ...).

A registry maps a config name to an entry (a function, a class or a small spec). The module that owns a
kind creates its registry and registers the built-in entries; a user adds one without editing the library::

    from starpo_jax.advantages import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("rloo")
    def rloo(inputs): ...

Config validation reads ``names()`` and ``check``, so a new name is accepted as soon as it is registered
and an unknown one is refused naming the config key and every registered name.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    Args:
      kind: what the entries are, for error messages (e.g. ``"advantage estimator"``).
      key: the config key that names an entry (e.g. ``"algorithm.adv_estimator"``).
    """

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T | None = None) -> Callable[[T], T] | T:
        """Adds ``entry`` under ``name``; without ``entry``, a decorator that adds what it decorates.

        Raises:
          ValueError: when ``name`` is already registered.
        """
        def add(value: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self.key})")
            self._entries[name] = value
            return value

        return add if entry is None else add(entry)

    def check(self, name: str, key: str | None = None) -> str:
        """Returns ``name``, or raises a ValueError naming ``key`` and the registered names."""
        if name not in self._entries:
            raise ValueError(f"{key or self.key} must be one of {self.names()} (the registered {self.kind}s), "
                             f"got {name!r}")
        return name

    def __getitem__(self, name: str) -> T:
        return self._entries[self.check(name)]

    def get(self, name: str, key: str | None = None) -> T:
        """The entry named ``name``; the error names ``key`` (default: the registry's key)."""
        return self._entries[self.check(name, key)]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def items(self):
        return self._entries.items()

    def unregister(self, name: str) -> T:
        """Removes and returns ``name``'s entry (tests that register temporary entries clean up with it)."""
        return self._entries.pop(self.check(name))
