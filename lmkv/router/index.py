"""The router's index: which instance can serve which prefix, from KV events.

Each instance publishes what its caches store and drop: vLLM's own prefix
cache (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, medium
``GPU``, ``CPU`` or none) and lmkv's tiers (the same events, medium
``lmkv:<tier>``). vLLM names blocks by hashes only it can compute (seeded per
process), so the index names them by its own: ``block_keys`` chains xxh3-64
over each whole block's token ids from a seed of the request's identity, and
an event's blocks get their keys from the tokens it carries and its parent's
key (looked up by the engine's hash of the parent). Per block the index keeps
one integer, two bits per instance: in the engine's own cache, in lmkv's
tiers.

Bounded: at most ``max_blocks`` blocks (the least recently stored go first),
at most ``MAX_INSTANCES`` instances; an instance not heard from for ``ttl_s``
is dropped with everything it held (``sweep``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

#: Instances one index tells apart (two bits each in a block's mask).
MAX_INSTANCES = 256
ENGINE, LMKV = 0, 1  # a lane's bits: the engine's own cache, lmkv's tiers


def block_keys(tokens: Sequence[int] | np.ndarray, block_size: int, seed: bytes = b"",
               parent: int | None = None) -> list[int]:
    """The index's keys of the whole ``block_size``-token blocks of ``tokens``: each
    the xxh3-64 of the one before (``parent``, or the ``seed``'s for the first:
    the request's identity, such as its LoRA adapter) and its token ids."""
    ids = np.asarray(tokens, dtype=np.uint32).tobytes()
    width = block_size * 4
    key = xxhash.xxh3_64_intdigest(b"lmkv-router\0" + seed) if parent is None else parent
    out = []
    for start in range(0, len(ids) - width + 1, width):
        key = xxhash.xxh3_64_intdigest(key.to_bytes(8, "little") + ids[start:start + width])
        out.append(key)
    return out


def lane_of(medium: str | None) -> int:
    return LMKV if medium is not None and medium.startswith("lmkv") else ENGINE


@dataclass(frozen=True)
class Match:
    """How far a prompt's blocks are held by one instance: in its engine's own cache
    (``engine``), and in that or lmkv's tiers (``cached``), in blocks."""

    engine: int
    cached: int


class KVIndex:
    def __init__(self, max_blocks: int = 1 << 20, ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._masks: dict[int, int] = {}  # block key -> two bits per instance
        self._order: OrderedDict[int, None] = OrderedDict()  # least recently stored first
        self._slots: dict[Hashable, int] = {}  # instance -> its lane
        self._names: dict[int, Hashable] = {}
        self._heard: dict[Hashable, float] = {}
        # (lane, engine's block hash) -> block key: parents and removals name blocks
        # so (bounded too: twice ``max_blocks``, the least recently named out first)
        self._by_hash: OrderedDict[tuple[int, Hashable], int] = OrderedDict()
        self._hashes: dict[int, set[Hashable]] = {}  # lane -> the engine hashes it named

    # -- events ---------------------------------------------------------------------
    def _lane(self, instance: Hashable) -> int | None:
        lane = self._slots.get(instance)
        if lane is None:
            free = next((i for i in range(MAX_INSTANCES) if i not in self._names), None)
            if free is None:
                return None
            self._slots[instance], self._names[free] = free, instance
            self._hashes[free] = set()
            lane = free
        self._heard[instance] = self.clock()
        return lane

    def heard(self, instance: Hashable) -> None:
        """A sign of life from ``instance`` (any event, a health check)."""
        self._lane(instance)

    def stored(self, instance: Hashable, hashes: Sequence[Hashable], tokens: Sequence[int],
               block_size: int, parent_hash: Hashable | None = None,
               medium: str | None = None, seed: bytes = b"") -> int:
        """``BlockStored``: the instance's blocks ``hashes`` (the engine's names) of
        ``tokens`` (whole blocks), after its block ``parent_hash`` (None: the
        prompt's first). Returns the blocks indexed (none when the parent is not
        known here: the chain cannot be named)."""
        lane = self._lane(instance)
        if lane is None:
            return 0
        parent = None
        if parent_hash is not None:
            parent = self._by_hash.get((lane, parent_hash))
            if parent is None:
                return 0
        keys = block_keys(tokens, block_size, seed, parent)
        bit = 1 << (2 * lane + lane_of(medium))
        masks, order, named = self._masks, self._order, self._hashes[lane]
        for engine_hash, key in zip(hashes, keys, strict=False):
            old = self._by_hash.get((lane, engine_hash))
            if old is not None and old != key:  # the engine's name now means another block
                self._drop_lane(old, lane)
            masks[key] = masks.get(key, 0) | bit
            order[key] = None
            order.move_to_end(key)
            self._by_hash[(lane, engine_hash)] = key
            self._by_hash.move_to_end((lane, engine_hash))
            named.add(engine_hash)
        self._trim()
        return min(len(hashes), len(keys))

    def removed(self, instance: Hashable, hashes: Sequence[Hashable],
                medium: str | None = None) -> None:
        """``BlockRemoved``: the instance no longer holds these blocks in ``medium``."""
        lane = self._slots.get(instance)
        if lane is None:
            return
        self._heard[instance] = self.clock()
        bit = 1 << (2 * lane + lane_of(medium))
        for engine_hash in hashes:
            key = self._by_hash.get((lane, engine_hash))
            if key is None:
                continue
            mask = self._masks.get(key, 0) & ~bit
            self._set(key, mask)
            if not mask >> (2 * lane) & 3:
                self._by_hash.pop((lane, engine_hash), None)
                self._hashes[lane].discard(engine_hash)

    def cleared(self, instance: Hashable) -> None:
        """``AllBlocksCleared``, or the instance is gone: it holds nothing."""
        lane = self._slots.get(instance)
        if lane is None:
            return
        lanes = ~(3 << (2 * lane))
        for engine_hash in self._hashes[lane]:
            key = self._by_hash.pop((lane, engine_hash), None)
            if key is not None and key in self._masks:
                self._set(key, self._masks[key] & lanes)
        self._hashes[lane] = set()

    def forget(self, instance: Hashable) -> None:
        """Drop ``instance`` and everything it held (its lane is free again)."""
        lane = self._slots.get(instance)
        if lane is None:
            return
        self.cleared(instance)
        del self._slots[instance], self._names[lane], self._heard[instance]
        del self._hashes[lane]

    def sweep(self) -> list[Hashable]:
        """Forget the instances not heard from for ``ttl_s``; returns them."""
        limit = self.clock() - self.ttl_s
        gone = [i for i, at in self._heard.items() if at < limit]
        for instance in gone:
            self.forget(instance)
        return gone

    def _set(self, key: int, mask: int) -> None:
        if mask:
            self._masks[key] = mask
        else:
            self._masks.pop(key, None)
            self._order.pop(key, None)

    def _trim(self) -> None:
        masks, order = self._masks, self._order
        while len(order) > self.max_blocks:
            key, _ = order.popitem(last=False)
            masks.pop(key, None)  # (its engine hashes go below, oldest first)
        by_hash = self._by_hash
        while len(by_hash) > 2 * self.max_blocks:
            # A block this lane can no longer name is no longer said to be its: a
            # removal could not reach its bits, nor could the next instance given
            # this lane tell them from its own.
            (lane, engine_hash), key = by_hash.popitem(last=False)
            self._drop_lane(key, lane)
            named = self._hashes.get(lane)
            if named is not None:
                named.discard(engine_hash)

    def _drop_lane(self, key: int, lane: int) -> None:
        mask = self._masks.get(key)
        if mask is not None:
            self._set(key, mask & ~(3 << (2 * lane)))

    # -- questions ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._masks)

    @property
    def instances(self) -> list[Hashable]:
        return list(self._slots)

    def match(self, keys: Sequence[int]) -> dict[Hashable, Match]:
        """For each instance that holds the first block: how many leading blocks of
        ``keys`` (``block_keys`` of the prompt) it holds, in its engine's cache and
        in that or lmkv's tiers."""
        masks = self._masks
        if not keys:
            return {}
        first = masks.get(keys[0], 0)
        if not first:
            return {}
        low = _LOW
        engine_run = first & low  # lanes still held in the engine, run unbroken
        any_run = (first | first >> 1) & low  # lanes still held anywhere
        engine_end: dict[int, int] = {}
        any_end: dict[int, int] = {}
        n = 0
        for n, key in enumerate(keys[1:], 1):
            mask = masks.get(key, 0)
            held = (mask | mask >> 1) & low
            next_engine = engine_run & mask
            next_any = any_run & held
            if next_engine != engine_run:
                _ends(engine_run & ~next_engine, n, engine_end)
            if next_any != any_run:
                _ends(any_run & ~next_any, n, any_end)
            engine_run, any_run = next_engine, next_any
            if not any_run:
                break
        else:
            n = len(keys)
        _ends(engine_run, n, engine_end)
        _ends(any_run, n, any_end)
        return {self._names[lane]: Match(engine_end.get(lane, 0), end)
                for lane, end in any_end.items() if lane in self._names}


_LOW = sum(1 << (2 * i) for i in range(MAX_INSTANCES))


def _ends(lanes: int, at: int, out: dict[int, int]) -> None:
    """Record ``at`` as the end of each lane set in ``lanes`` (low bits of lanes)."""
    while lanes:
        low = lanes & -lanes
        out[(low.bit_length() - 1) // 2] = at
        lanes ^= low
