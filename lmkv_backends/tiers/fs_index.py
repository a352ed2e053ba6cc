"""What the ``fs`` tier knows of its entries: names, sizes, pins and the byte budget.

Entry names are ``quote(key.to_string()) + ".lmkv"``: ``/`` and every other
character that a file or object name cannot carry is percent-escaped, and the
key comes back with ``CacheKey.from_string``. The index is this process's
view; the storage itself stays the truth (other processes may add or remove
entries), so callers adopt what they find there and discard what vanished.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Hashable, Iterable, Sequence
from urllib.parse import quote, unquote

from lmkv.contracts.policy import EvictionPolicy
from lmkv.keys.chunking import CacheKey
from lmkv.keys.slots import SlotKeys

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

    Compact, as the cpu tier's index: keys numbered by slot (``SlotKeys``), an
    entry's size in an array by slot, pins only for the entries pinned; a
    policy that orders slots (every built-in one) is handed slots, any other
    keys. A million entries cost a few hundred MiB, not a gigabyte
    (bench_metadata.py).
    """

    def __init__(self, policy: EvictionPolicy, capacity: int | None) -> None:
        self.policy = policy
        self.capacity = capacity
        self._keys = SlotKeys()
        self._size = array("q")  # per slot: the entry's size; -1: not stored
        self._pins: dict[int, int] = {}  # slot -> pins, for the entries pinned
        self._writing: set[CacheKey] = set()
        self._lock = threading.Lock()
        self._count = 0
        self.usage = 0  # bytes of the entries in the index
        self.reserved = 0  # bytes of writes in flight
        self._by_slot = policy.orders_slots
        if self._by_slot:
            policy.order_slots(self._keys.key)

    def __len__(self) -> int:
        return self._count

    # -- slots ---------------------------------------------------------------
    def _stored(self, key: CacheKey) -> int:
        """``key``'s slot when it is stored, else -1."""
        slot = self._keys.slot(key)
        return -1 if slot is None or self._size[slot] < 0 else slot

    def _claim(self, key: CacheKey) -> int:
        """A slot for ``key`` (its own, or a new one, not stored yet)."""
        slot = self._keys.add(key)
        if slot == len(self._size):
            self._size.append(-1)
        return slot

    def _name(self, slot: int, key: CacheKey | None = None) -> Hashable:
        """What the policy calls the entry: its slot, or its key."""
        if self._by_slot:
            return slot
        return key if key is not None else self._keys.key(slot)

    def _parent_name(self, parent: CacheKey | None) -> Hashable | None:
        """The parent as the policy names it (a slot for a policy ordering slots,
        held while stored entries name it, stored here or not)."""
        if parent is None or not self._by_slot:
            return parent
        return self._claim(parent)

    def _release(self, slot: int) -> None:
        """Give ``slot`` back unless it is stored or a stored entry names it."""
        if self._size[slot] >= 0 or (self._by_slot and self.policy.lineage.children(slot)):
            return
        self._keys.remove(slot)

    def _insert_locked(self, key: CacheKey, size: int, parent: CacheKey | None) -> int:
        slot = self._claim(key)
        self._size[slot] = size
        self._count += 1
        self.usage += size
        self.policy.insert(self._name(slot, key), self._parent_name(parent))
        return slot

    # -- lookups -------------------------------------------------------------
    def lookup(self, key: CacheKey, pin: bool = False) -> bool:
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            if pin:
                self._pins[slot] = self._pins.get(slot, 0) + 1
            return True

    def count_prefix(self, keys: Sequence[CacheKey], pin: bool = False) -> int:
        """How many leading ``keys`` the index holds (pinning them when asked)."""
        hits = 0
        with self._lock:
            pins = self._pins
            for key in keys:
                slot = self._stored(key)
                if slot < 0:
                    break
                if pin:
                    pins[slot] = pins.get(slot, 0) + 1
                hits += 1
        return hits

    def unpin(self, key: CacheKey) -> bool:
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            left = self._pins.get(slot, 0) - 1
            if left > 0:
                self._pins[slot] = left
            elif left == 0:
                del self._pins[slot]
            return True

    def touch(self, key: CacheKey) -> None:
        with self._lock:
            slot = self._stored(key)
            if slot >= 0:
                self.policy.access(self._name(slot, key))

    # -- changes -------------------------------------------------------------
    def adopt(self, key: CacheKey, size: int, pin: bool = False,
              parent: CacheKey | None = None) -> None:
        """Record an entry found in storage (written by us earlier or by someone else)."""
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                slot = self._insert_locked(key, size, parent)
            elif self._size[slot] != size:
                self.usage += size - self._size[slot]
                self._size[slot] = size
            if pin:
                self._pins[slot] = self._pins.get(slot, 0) + 1

    def adopt_all(self, found: Iterable[tuple[CacheKey, int]]) -> None:
        for key, size in found:
            self.adopt(key, size)

    def discard(self, key: CacheKey) -> bool:
        """Forget ``key`` (removed, vanished or corrupt); pins do not keep it."""
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            self._drop_locked(slot)
            return True

    def _drop_locked(self, slot: int) -> int:
        """Forget a stored slot and its pins: its size."""
        size = self._size[slot]
        parent = self.policy.lineage.parent(slot) if self._by_slot else None
        self.policy.forget(self._name(slot))
        self._pins.pop(slot, None)
        self._size[slot] = -1
        self._count -= 1
        self.usage -= size
        self._release(slot)
        if parent is not None:
            self._release(parent)  # type: ignore[arg-type]  # a slot: by_slot
        return size

    def begin_write(self, key: CacheKey) -> bool:
        """Claim ``key`` for one writer; False when it is stored or being written."""
        with self._lock:
            if self._stored(key) >= 0 or key in self._writing:
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
                    self._insert_locked(key, entry_size, parent)
                return None
            self.reserved += size
            return evicted

    def _evict_locked(self, excess: int) -> tuple[list[tuple[CacheKey, int]],
                                                  list[CacheKey | None]]:
        """Drop unpinned entries in policy order until ``excess`` bytes went or no
        pass finds another: the dropped (key, size) and their parents."""
        evicted: list[tuple[CacheKey, int]] = []
        parents: list[CacheKey | None] = []
        lineage, sizes, pins = self.policy.lineage, self._size, self._pins
        while excess > 0:
            victims: list[int] = []
            for name in self.policy.candidates():
                slot = self._slot_of(name)  # the policy orders only this tier's keys
                if slot < 0 or slot in pins:
                    continue
                victims.append(slot)
                excess -= sizes[slot]
                if excess <= 0:
                    break
            if not victims:
                break
            for slot in victims:
                if sizes[slot] < 0:  # named twice by the policy: dropped already
                    continue
                key = self._keys.key(slot)
                # the parent before the drop makes the policy forget it
                parent = lineage.parent(self._name(slot, key))
                if self._by_slot:
                    parent = None if parent is None else self._keys.key(parent)  # type: ignore[arg-type]
                parents.append(parent if isinstance(parent, CacheKey) else None)
                evicted.append((key, self._drop_locked(slot)))
        return evicted, parents

    def _slot_of(self, name: Hashable) -> int:
        """A stored slot from what the policy names; -1 for anything else."""
        slot = self._keys.slot_named(name, self._by_slot)
        return slot if slot >= 0 and self._size[slot] >= 0 else -1

    def release(self, reserved: int) -> None:
        with self._lock:
            self.reserved -= reserved

    def commit(self, key: CacheKey, reserved: int, size: int,
               parent: CacheKey | None = None) -> None:
        """A reserved write landed: the entry is stored."""
        with self._lock:
            self.reserved -= reserved
            if self._stored(key) < 0:
                self._insert_locked(key, size, parent)

    def excess_victims(self) -> list[tuple[CacheKey, int]]:
        """Unpinned entries to evict until usage fits the budget (after a restart
        with a smaller budget), in passes as ``reserve`` evicts."""
        with self._lock:
            if self.capacity is None:
                return []
            return self._evict_locked(self.usage + self.reserved - self.capacity)[0]

    def candidates(self) -> list[CacheKey]:
        """The keys the policy would evict first first (leaves only)."""
        with self._lock:
            slots = [self._slot_of(name) for name in self.policy.candidates()]
            return [self._keys.key(slot) for slot in slots if slot >= 0]
