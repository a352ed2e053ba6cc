"""Cache keys numbered by dense slots, held compactly.

A tier that holds hundreds of thousands of small chunks cannot afford a
Python object per key in each of its structures. ``SlotKeys`` gives each
key a slot (a small int, reused after the key leaves) and keeps the key
itself as its chunk hash, grouped by (meta, layer): the key's meta is held
once, not per key, and the caller's ``CacheKey`` is not kept. The C
accelerator's (``lmkv._ext._slots``, the default where it is built) keeps one
open-addressing table of slots; the Python one here a dict per (meta,
layer). The
tier's own records, and an eviction policy that orders slots
(``EvictionPolicy.orders_slots``), live in arrays indexed by slot.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from lmkv.keys.chunking import CacheKey, KeyMeta

_TAG_MASK = (1 << 64) - 1

#: One (meta, layer): its meta, layer, chunk hash -> slot, its number, and its tag
#: (a hash of meta and layer: what its keys' names carry, the same whichever number
#: the space has).
_Space = tuple[KeyMeta, int, dict[bytes | int, int], int, int]


class PySlotKeys:
    """CacheKey <-> slot. Not thread-safe: its tier's lock guards it.

    The pure-Python one: ``SlotKeys`` is the C accelerator's where it is built
    (``lmkv._ext._slots``), with the same slots, keys and names, op for op."""

    __slots__ = ("_free", "_free_spaces", "_hash_of", "_last", "_space_ids", "_space_of",
                 "_spaces")

    def __init__(self) -> None:
        #: (meta, layer) -> space number; per space: meta, layer, chunk hash -> slot,
        #: and its number.
        self._space_ids: dict[tuple[KeyMeta, int], int] = {}
        self._spaces: list[_Space | None] = []  # None: a number free for another space
        self._free_spaces: list[int] = []
        self._space_of = array("I")  # each slot's space
        # Each slot's chunk hash (None: free). A sha256 digest (32 bytes) is held as
        # the int it spells (64 bytes of memory; its bytes object takes 80), any
        # other length as its bytes: an int never equals a bytes object.
        self._hash_of: list[bytes | int | None] = []
        self._free: list[int] = []
        self._last: _Space | None = None

    def __len__(self) -> int:
        return len(self._hash_of) - len(self._free)

    @property
    def capacity(self) -> int:
        """One past the highest slot ever given (what arrays by slot must hold)."""
        return len(self._hash_of)

    def _space(self, meta: KeyMeta, layer: int) -> _Space | None:
        """The space of ``meta``/``layer``: (meta, layer, hash -> slot, its number)."""
        last = self._last
        if last is not None and last[1] == layer and (last[0] is meta or last[0] == meta):
            return last  # a tier sees one meta almost always: skip hashing it
        number = self._space_ids.get((meta, layer))
        if number is None:
            return None
        self._last = self._spaces[number]
        return self._last

    def slot(self, key: CacheKey) -> int | None:
        """``key``'s slot, or None when it has none."""
        space = self._last
        if space is None or space[0] is not key.meta or space[1] != key.layer:
            space = self._space(key.meta, key.layer)
            if space is None:
                return None
        digest = key.chunk_hash
        return space[2].get(int.from_bytes(digest, "little") if len(digest) == 32 else digest)

    def add(self, key: CacheKey) -> int:
        """A slot for ``key``: its own if it has one, else a new one."""
        space = self._last  # (the space of the last key, almost always this one's)
        if space is None or space[0] is not key.meta or space[1] != key.layer:
            space = self._space(key.meta, key.layer)
        if space is None:
            number = self._free_spaces.pop() if self._free_spaces else len(self._spaces)
            self._space_ids[(key.meta, key.layer)] = number
            tag = hash((key.meta, key.layer)) & _TAG_MASK
            space = self._last = (key.meta, key.layer, {}, number, tag)
            if number == len(self._spaces):
                self._spaces.append(space)
            else:
                self._spaces[number] = space
        table = space[2]
        digest: bytes | int = key.chunk_hash
        if len(digest) == 32:  # type: ignore[arg-type]
            digest = int.from_bytes(digest, "little")  # type: ignore[arg-type]
        slot = table.get(digest)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._hash_of[slot] = digest
            self._space_of[slot] = space[3]
        else:
            slot = len(self._hash_of)
            self._hash_of.append(digest)
            self._space_of.append(space[3])
        table[digest] = slot
        return slot

    def add_many(self, keys: Sequence[CacheKey]) -> list[int]:
        """``add`` of each key, in order: their slots."""
        return [self.add(key) for key in keys]

    def space_number(self, slot: int) -> int:
        """The number of the space (meta, layer) of the key ``slot`` holds."""
        self._check(slot)
        if self._hash_of[slot] is None:
            raise KeyError(f"slot {slot} is free")
        return self._space_of[slot]

    def slot_named(self, name: Hashable, by_slot: bool) -> int:
        """The slot an eviction policy's name stands for: the name itself for a
        policy ordering slots (``by_slot``), else the slot of the key it names;
        -1 for anything else (whether that slot is stored is the tier's to say)."""
        if by_slot:
            return name if type(name) is int and 0 <= name < len(self._hash_of) else -1
        found = self.slot(name) if isinstance(name, CacheKey) else None
        return -1 if found is None else found

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self._hash_of):
            raise IndexError(f"slot {slot} out of range")

    def key(self, slot: int) -> CacheKey:
        """The key of a slot in use (a new CacheKey, equal to the one added)."""
        self._check(slot)
        digest = self._hash_of[slot]
        if digest is None:
            raise KeyError(f"slot {slot} is free")
        space = self._spaces[self._space_of[slot]]
        assert space is not None
        meta, layer = space[0], space[1]
        if type(digest) is int:
            digest = digest.to_bytes(32, "little")
        return CacheKey(meta, digest, layer)  # type: ignore[arg-type]

    def name(self, slot: int) -> Hashable:
        """A name for the key ``slot`` holds now that outlives the slot (a slot is
        given to another key once its key leaves): equal keys get equal names,
        made of what the index holds already (no key is built): its chunk hash and
        its space's tag, which a (meta, layer) keeps whichever space number it
        gets. Two keys share a name only when their chunk hashes are equal and
        their (meta, layer) tags collide (64-bit hashes): fit for what a policy
        remembers of keys that left, never to find an entry."""
        self._check(slot)
        digest = self._hash_of[slot]
        if digest is None:
            raise KeyError(f"slot {slot} is free")
        space = self._spaces[self._space_of[slot]]
        assert space is not None
        if type(digest) is int:
            return digest ^ (space[4] << 256)
        return (space[4], digest)

    def remove(self, slot: int) -> None:
        """Give ``slot`` back: its key has none from now on."""
        self._check(slot)
        digest = self._hash_of[slot]
        if digest is None:
            return
        number = self._space_of[slot]
        space = self._spaces[number]
        assert space is not None
        del space[2][digest]
        self._hash_of[slot] = None
        self._free.append(slot)
        if not space[2]:  # its last key left: models seen once cost nothing after
            del self._space_ids[(space[0], space[1])]
            self._spaces[number] = None
            self._free_spaces.append(number)
            if self._last is space:
                self._last = None

    def slots(self) -> list[int]:
        """Every slot in use."""
        return [slot for slot, digest in enumerate(self._hash_of) if digest is not None]


# The optional C accelerator (setup.py): the same answers, without a Python frame
# per key, and a smaller index (its chunk hash, space and a table entry per key).
try:
    from lmkv._ext import _slots as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None  # type: ignore[assignment]

if TYPE_CHECKING:
    SlotKeys = PySlotKeys
elif _native is not None:
    class SlotKeys(_native.SlotKeys):
        """CacheKey <-> slot (in C). Not thread-safe: its tier's lock guards it."""

        __slots__ = ()

        def __init__(self) -> None:
            super().__init__(CacheKey)
else:  # pragma: no cover - depends on the build
    SlotKeys = PySlotKeys
