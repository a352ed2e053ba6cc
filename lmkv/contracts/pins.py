"""``PinTable``: the pins a remote tier holds for this process.

A tier whose storage lives in another process (Redis, a Mooncake pool) cannot
stop that storage from evicting an entry; its pins are local: they say what
this process is about to read (a lookup's hits, until its get), and a pinned
entry the storage evicted meanwhile is simply a miss when it is read. A tier
author keeps one ``PinTable`` keyed by the names the tier stores entries
under: ``pin`` the leading hits of a lookup (with what the lookup saw of
each, if the get can use it: the redis tier records an entry's part count so
the get fetches every part in one round trip), ``unpin`` one pin at a time,
``seen`` at get time, ``len`` for the ``pinned_keys`` figure.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Pin(Generic[T]):
    count: int
    seen: T | None


class PinTable(Generic[T]):
    """Pin counts by entry name, with what the latest lookup saw of each entry.
    Thread-safe: lookups, gets and unpins come from several threads."""

    def __init__(self) -> None:
        self._pins: dict[str, _Pin[T]] = {}
        self._lock = threading.Lock()

    def pin(self, names: Sequence[str], seen: Sequence[T] | None = None) -> None:
        """One more pin on each of ``names``; ``seen`` (one per name) replaces what
        was recorded of each."""
        if seen is not None and len(seen) != len(names):
            raise ValueError(f"pin: {len(names)} names but {len(seen)} seen values")
        with self._lock:
            for i, name in enumerate(names):
                entry = self._pins.get(name)
                if entry is None:
                    self._pins[name] = _Pin(1, seen[i] if seen is not None else None)
                else:
                    entry.count += 1
                    if seen is not None:
                        entry.seen = seen[i]

    def unpin(self, name: str) -> bool:
        """Release one pin on ``name``; False when this process held none."""
        with self._lock:
            entry = self._pins.get(name)
            if entry is None:
                return False
            entry.count -= 1
            if entry.count == 0:
                del self._pins[name]
            return True

    def seen(self, name: str, default: T) -> T:
        """What the lookup that pinned ``name`` last saw of it, else ``default``."""
        entry = self._pins.get(name)  # (a plain dict read: atomic under the GIL)
        return default if entry is None or entry.seen is None else entry.seen

    def count(self, name: str) -> int:
        """The pins this process holds on ``name``."""
        entry = self._pins.get(name)
        return 0 if entry is None else entry.count

    def __len__(self) -> int:
        """Entries pinned (each counted once, however many pins it has)."""
        return len(self._pins)

    def clear(self) -> None:
        """Drop every pin (the tier is closing)."""
        with self._lock:
            self._pins.clear()
