"""What the ``fs`` tier knows of its entries: names, sizes, pins and the byte budget.

Entry names are ``quote(key.to_string()) + ".lmkv"``: ``/`` and every other
character that a file or object name cannot carry is percent-escaped, and the
key comes back with ``CacheKey.from_string``. The index is this process's
view; the storage itself stays the truth (other processes may add or remove
entries), so callers adopt what they find there and discard what vanished.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from urllib.parse import quote, unquote

from lmkv.contracts.policy import EvictionPolicy
from lmkv.keys.chunking import CacheKey

SUFFIX = ".lmkv"


class NotAnEntry(OSError):
    """Something other than a regular file (a directory, FIFO, socket, device,
    symlink) sits under an entry's name: never read, never a hit, left alone."""


def entry_name(key: CacheKey) -> str:
    name = quote(key.to_string(), safe="@")
    if name.startswith("."):  # leading dots are hidden files (and our temporaries)
        name = "%2E" + name[1:]
    return name + SUFFIX


def key_of(name: str) -> CacheKey | None:
    """The key an entry name stands for; None for anything that is not an entry."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    try:
        return CacheKey.from_string(unquote(name[:-len(SUFFIX)], errors="strict"))
    except (ValueError, UnicodeDecodeError):
        return None


class EntryIndex:
    """Thread-safe map of stored entries, their eviction order and the byte budget.

    ``reserve`` accounts a write before it starts, so parallel writers never
    take the tier past ``capacity`` together; it picks unpinned victims in
    the policy's order and hands them back for the caller to delete.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int | None) -> None:
        self.policy = policy
        self.capacity = capacity
        # Each entry's size; pins only for the entries pinned (few at any time): an
        # entry costs the index one dict slot and its key (bench_metadata.py).
        self._entries: dict[CacheKey, int] = {}
        self._pins: dict[CacheKey, int] = {}
        self._writing: set[CacheKey] = set()
        self._lock = threading.Lock()
        self.usage = 0  # bytes of the entries in the index
        self.reserved = 0  # bytes of writes in flight

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups -------------------------------------------------------------
    def lookup(self, key: CacheKey, pin: bool = False) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            if pin:
                self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def count_prefix(self, keys: Sequence[CacheKey], pin: bool = False) -> int:
        """How many leading ``keys`` the index holds (pinning them when asked)."""
        hits = 0
        with self._lock:
            entries, pins = self._entries, self._pins
            for key in keys:
                if key not in entries:
                    break
                if pin:
                    pins[key] = pins.get(key, 0) + 1
                hits += 1
        return hits

    def unpin(self, key: CacheKey) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            elif left == 0:
                del self._pins[key]
            return True

    def touch(self, key: CacheKey) -> None:
        with self._lock:
            if key in self._entries:
                self.policy.access(key)

    # -- changes -------------------------------------------------------------
    def adopt(self, key: CacheKey, size: int, pin: bool = False,
              parent: CacheKey | None = None) -> None:
        """Record an entry found in storage (written by us earlier or by someone else)."""
        with self._lock:
            known = self._entries.get(key)
            if known is None:
                self._entries[key] = size
                self.usage += size
                self.policy.insert(key, parent)
            elif known != size:
                self.usage += size - known
                self._entries[key] = size
            if pin:
                self._pins[key] = self._pins.get(key, 0) + 1

    def adopt_all(self, found: Iterable[tuple[CacheKey, int]]) -> None:
        for key, size in found:
            self.adopt(key, size)

    def discard(self, key: CacheKey) -> bool:
        """Forget ``key`` (removed, vanished or corrupt); pins do not keep it."""
        with self._lock:
            return self._drop_locked(key) is not None

    def _drop_locked(self, key: CacheKey) -> int | None:
        """Forget ``key`` and its pins: its size, or None when it was not there."""
        size = self._entries.pop(key, None)
        if size is not None:
            self._pins.pop(key, None)
            self.usage -= size
            self.policy.forget(key)
        return size

    def begin_write(self, key: CacheKey) -> bool:
        """Claim ``key`` for one writer; False when it is stored or being written."""
        with self._lock:
            if key in self._entries or key in self._writing:
                return False
            self._writing.add(key)
            return True

    def end_write(self, key: CacheKey) -> None:
        with self._lock:
            self._writing.discard(key)

    def reserve(self, size: int) -> list[tuple[CacheKey, int]] | None:
        """Account ``size`` bytes for a write, evicting unpinned entries in policy
        order; returns the evicted (key, size) for the caller to delete, or None
        (nothing changed) when the room cannot be made.

        The policy offers leaves only, so this evicts in passes: a prompt's tail
        goes, then the chunk before it is a leaf and may go in the next pass.
        When even that cannot make room, the entries dropped are put back (with
        their parents) and nothing changed for the caller.
        """
        with self._lock:
            if self.capacity is None:
                self.reserved += size
                return []
            if size > self.capacity:
                return None
            excess = self.usage + self.reserved + size - self.capacity
            evicted, parents = self._evict_locked(excess)
            if sum(s for _, s in evicted) < excess:
                for (key, entry_size), parent in zip(reversed(evicted), reversed(parents),
                                                     strict=True):
                    self._entries[key] = entry_size
                    self.usage += entry_size
                    self.policy.insert(key, parent)
                return None
            self.reserved += size
            return evicted

    def _evict_locked(self, excess: int) -> tuple[list[tuple[CacheKey, int]],
                                                  list[CacheKey | None]]:
        """Drop unpinned entries in policy order until ``excess`` bytes went or no
        pass finds another: the dropped (key, size) and their parents."""
        evicted: list[tuple[CacheKey, int]] = []
        parents: list[CacheKey | None] = []
        lineage = self.policy.lineage
        while excess > 0:
            victims: list[CacheKey] = []
            entries, pins = self._entries, self._pins
            for key in self.policy.candidates():
                if not isinstance(key, CacheKey):  # the policy orders only this tier's keys
                    continue
                size = entries.get(key)
                if size is None or key in pins:
                    continue
                victims.append(key)
                excess -= size
                if excess <= 0:
                    break
            if not victims:
                break
            for key in victims:
                parent = lineage.parent(key)  # before the drop makes the policy forget it
                dropped = self._drop_locked(key)
                if dropped is None:  # named twice by the policy: dropped already
                    continue
                parents.append(parent if isinstance(parent, CacheKey) else None)
                evicted.append((key, dropped))
        return evicted, parents

    def release(self, reserved: int) -> None:
        with self._lock:
            self.reserved -= reserved

    def commit(self, key: CacheKey, reserved: int, size: int,
               parent: CacheKey | None = None) -> None:
        """A reserved write landed: the entry is stored."""
        with self._lock:
            self.reserved -= reserved
            if key not in self._entries:
                self._entries[key] = size
                self.usage += size
                self.policy.insert(key, parent)

    def excess_victims(self) -> list[tuple[CacheKey, int]]:
        """Unpinned entries to evict until usage fits the budget (after a restart
        with a smaller budget), in passes as ``reserve`` evicts."""
        with self._lock:
            if self.capacity is None:
                return []
            return self._evict_locked(self.usage + self.reserved - self.capacity)[0]
