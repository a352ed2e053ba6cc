"""The ``cpu`` tier: chunk buffers kept in one host-memory arena.

Entries are MemoryObjs in a dict; a full arena evicts unpinned, unreferenced
entries in the order of the tier's eviction policy and never allocates past
``max_bytes``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Annotated

import torch
from pydantic import ByteSize, Field, field_validator
from pydantic_core import PydanticCustomError

from lmkv.base.errors import ConfigError
from lmkv.base.units import ByteCount
from lmkv.contracts.plugin import OptionsArg, PluginOptions
from lmkv.contracts.tier import ArenaPlacement, BackendContext, StorageBackend, done_future
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryAllocator, MemoryObj, nbytes_of
from lmkv.memory.shm import SharedMemoryUnavailable, SharedSegment, available_memory_bytes

logger = logging.getLogger(__name__)

#: The default ``prefault_ahead``'s ceiling: a 4096-token Llama-3-8B bf16 prefix.
PREFAULT_AHEAD = 512 << 20
#: The largest ``max_bytes``: more than a 64-bit process can map (x86-64's 57-bit
#: addresses), so anything past it is a slip, and its figures stay readable.
MAX_ARENA_BYTES = 64 << 50


class CPUOptions(PluginOptions):
    max_bytes: Annotated[ByteCount, Field(ge=4096)] = ByteSize(4 << 30)
    """Hard budget of the arena, e.g. ``512MiB`` or ``8GiB``."""
    pin_memory: bool | None = None
    """Page-locked arena for fast GPU copies; default: when CUDA is available."""
    shared_memory: bool | None = None
    """Place the arena in a named shared-memory segment that other processes on this
    machine map; the arena is then not page-locked. Default: where the process asks
    for it (the ``lmkv server`` does, for its first memory tier, and falls back to
    private memory when no segment can be made); true: a segment or an error."""
    huge_pages: bool = False
    """Advise transparent huge pages for the arena (not page-locked, not shared):
    copies of large chunks out of it run faster (fewer TLB misses), first touches
    of its pages cost more."""
    prefault_ahead: ByteCount | None = None
    """Bytes of a private, not page-locked arena kept faulted in past the highest
    offset used so far, by a background thread, so chunks read in from a lower tier
    (or stored) land on pages that are already there; 0: off. Default:
    ``max_bytes / 16``, at most ``PREFAULT_AHEAD``."""
    allow_overcommit: bool = False
    """Make the arena even when ``max_bytes`` is larger than the memory this machine
    has available when it is made; off: that is an error there (the arena would
    fail, or swap, once it fills). ``config check`` warns either way."""

    @field_validator("max_bytes")
    @classmethod
    def _addressable(cls, value: ByteSize) -> ByteSize:
        if value > MAX_ARENA_BYTES:
            raise PydanticCustomError(
                "arena_too_large", "must be at most {most} (more than a 64-bit process "
                "can map)", {"most": ByteSize(MAX_ARENA_BYTES).human_readable()})
        return value

    def memory_shortfall(self) -> str | None:
        """Why ``max_bytes`` cannot be had on this machine now, or None. Asked when the
        arena is made (an error there) and by ``config check`` (a warning): never at
        validation, since a config's validity must not depend on this moment's free
        memory. The default budget is lmkv's choice, not the user's, and is not
        held against a small machine (the arena's pages are taken as it fills)."""
        if "max_bytes" not in self.model_fields_set:
            return None
        available = available_memory_bytes()
        if available is None or self.max_bytes <= available:
            return None
        return (f"more than the memory this machine has available "
                f"({ByteSize(available).human_readable()})")

    def startup_warnings(self) -> dict[str, str]:
        shortfall = self.memory_shortfall()
        if shortfall is None:
            return {}
        then = ("the arena is made anyway (allow_overcommit: true) and may fail or swap "
                "as it fills" if self.allow_overcommit else
                "the tier will not start here: lower it, or set allow_overcommit: true")
        return {"max_bytes": f"{self.max_bytes.human_readable()} is {shortfall}; {then}"}


class CPUBackend(StorageBackend):
    name = "cpu"
    api_version = "2.0"
    Options = CPUOptions
    options: CPUOptions
    holds_memory_objs = True

    def __init__(self, options: OptionsArg = None, context: BackendContext | None = None) -> None:
        super().__init__(options, context)
        options, context = self.options, self.context
        if context.eviction_policy is None:
            raise ValueError("the cpu tier needs an eviction policy")
        self.policy = context.eviction_policy
        # A dry run (``lmkv config check``) makes no arena: whether max_bytes can be
        # had depends on this machine now, not on the config.
        self.shared_segment: SharedSegment | None
        self.allocator: MemoryAllocator
        if context.dry_run:
            self.shared_segment, self.allocator = None, MemoryAllocator(1 << 16,
                                                                        pin_memory=False)
        else:
            self.shared_segment, self.allocator = self._arena(options, context)
        self._entries: dict[CacheKey, MemoryObj] = {}
        self._lock = threading.Lock()
        self._stored_bytes = 0

    @classmethod
    def _arena(cls, options: CPUOptions, context: BackendContext
               ) -> tuple[SharedSegment | None, MemoryAllocator]:
        """The arena's segment (None: private memory) and its allocator. An arena
        that cannot be had at all (``max_bytes`` past what the kernel maps, with
        ``allow_overcommit``) is a ConfigError naming the key, not a traceback."""
        key = f"config key 'tiers.{context.tier_index}.options.max_bytes'"
        shortfall = None if options.allow_overcommit else options.memory_shortfall()
        if shortfall is not None:
            raise ConfigError(f"{key} = {options.max_bytes.human_readable()}: {shortfall}; "
                              "lower it, or set allow_overcommit: true")
        segment, no_segment = cls._shared_segment(options, context.arena)
        try:
            ahead = options.prefault_ahead
            allocator = MemoryAllocator(
                int(options.max_bytes), pin_memory=options.pin_memory,
                buffer=segment.tensor if segment else None, huge_pages=options.huge_pages,
                prefault_ahead=int(ahead) if ahead is not None
                else min(PREFAULT_AHEAD, int(options.max_bytes) // 16))
        except (OSError, MemoryError, RuntimeError) as exc:  # RuntimeError: pinned memory
            if segment is not None:
                segment.close()
            reason = getattr(exc, "strerror", None) or " ".join(
                f"{type(exc).__name__}: {exc}".split())
            if no_segment:
                reason = f"{no_segment}; private memory: {reason}"
            raise ConfigError(
                f"{key} = {options.max_bytes.human_readable()}: the arena could not be "
                "allocated "
                f"({reason}); lower max_bytes") from None
        if no_segment:  # said only now: had the arena failed, the error says it all
            logger.warning("lmkv cpu tier: %s; the arena stays in private memory, so "
                           "clients of the lmkv server cannot map it", no_segment)
        return segment, allocator

    @staticmethod
    def _shared_segment(options: CPUOptions, arena: ArenaPlacement
                        ) -> tuple[SharedSegment | None, str]:
        """The segment the arena goes in: what ``shared_memory`` says, else what the
        process asks (``arena``); a segment it only asked for is given up (and why is
        returned, for a warning) when it cannot be made."""
        if options.shared_memory is False or (
                options.shared_memory is None and arena is not ArenaPlacement.SHARED):
            return None, ""
        try:
            return SharedSegment.create(int(options.max_bytes)), ""
        except SharedMemoryUnavailable as exc:
            if options.shared_memory:
                raise
            return None, str(exc)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def usage_bytes(self) -> int:
        return self._stored_bytes

    def __len__(self) -> int:
        return len(self._entries)

    # -- memory ----------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer from this tier's arena, evicting as needed; None when nothing can go."""
        obj = self.allocator.allocate(shape, dtype)
        if obj is not None:
            return obj
        with self._lock:
            return self._allocate_evicting(shape, dtype)

    def _allocate_evicting(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        size = nbytes_of(shape, dtype)
        if size > self.allocator.capacity_bytes:
            return None
        rounds = 0
        while True:
            obj = self.allocator.allocate(shape, dtype)
            if obj is not None:
                return obj
            if rounds == 1 and not self._could_fit(size):
                return None  # fragmented around pinned or referenced entries
            if not self._evict_locked(max(1, size - self.allocator.largest_free_block)):
                return None
            rounds += 1

    def _could_fit(self, size: int) -> bool:
        """Whether evicting every evictable entry would leave a contiguous block of ``size``.

        Only asked when an eviction did not make room (odd sizes, pinned neighbours):
        with uniform chunks the first eviction always does.
        """
        blocks = self.allocator.free_blocks()
        blocks += [(o.offset, o.nbytes) for o in self._entries.values() if o.is_evictable]
        blocks.sort()
        run_start, run_end = -1, -1
        for start, length in blocks:
            if start != run_end:
                run_start = start
            run_end = start + length
            if run_end - run_start >= size:
                return True
        return False

    def _evict_locked(self, needed: int) -> int:
        """Evict unpinned, unreferenced entries in policy order; returns bytes freed."""
        victims: list[CacheKey] = []
        freed = 0
        for key in self.policy.candidates():
            if not isinstance(key, CacheKey):  # the policy orders only this tier's keys
                continue
            obj = self._entries[key]
            if obj.is_evictable:
                victims.append(key)
                freed += obj.nbytes
                if freed >= needed:
                    break
        for key in victims:
            self._drop_locked(key)
        self.counters.evictions += len(victims)
        return freed

    def _drop_locked(self, key: CacheKey) -> MemoryObj:
        obj = self._entries.pop(key)
        self.policy.forget(key)
        self._stored_bytes -= obj.nbytes
        obj.ref_down()
        return obj

    # -- contract ----------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                return False
            if pin:
                obj.pin()
            return True

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        hits = 0
        with self._lock:
            entries = self._entries
            for key in keys:
                obj = entries.get(key)
                if obj is None:
                    break
                if pin:
                    obj.pin()
                hits += 1
        return hits

    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        stored = 0
        lineage = parents if parents is not None else [None] * len(keys)
        with self._lock:
            entries, policy = self._entries, self.policy
            for key, obj, parent in zip(keys, objs, lineage, strict=True):
                if key in entries:
                    continue
                if obj.allocator is self.allocator:
                    if not obj.ref_up():
                        continue  # a released buffer: never store it
                else:
                    copy = self._allocate_evicting(obj.shape, obj.dtype)
                    if copy is None:
                        self.counters.dropped_writes += 1
                        continue
                    try:
                        copy.tensor.copy_(obj.tensor)
                    except BaseException:
                        copy.ref_down()
                        raise
                    obj = copy
                entries[key] = obj
                policy.insert(key, parent)
                self._stored_bytes += obj.nbytes
                stored += 1
                self.counters.bytes_in += obj.nbytes
            self.counters.puts += stored
        return done_future(stored)

    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                self.counters.misses += 1
                return None
            obj.ref_up()
            self.policy.access(key)
            self.counters.hits += 1
            self.counters.bytes_out += obj.nbytes
            return obj

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        out: list[MemoryObj] = []
        with self._lock:
            entries, policy = self._entries, self.policy
            for key in keys:
                obj = entries.get(key)
                if obj is None:
                    break
                obj.ref_up()
                policy.access(key)
                out.append(obj)
            self.counters.hits += len(out)
            self.counters.misses += len(keys) - len(out)
            self.counters.bytes_out += sum(o.nbytes for o in out)
        return done_future(out)

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                return False
            obj.unpin()
            return True

    def remove(self, key: CacheKey) -> bool:
        """Drop ``key``; a pinned entry is protected and stays (returns False)."""
        with self._lock:
            obj = self._entries.get(key)
            if obj is None or obj.pin_count:
                return False
            self._drop_locked(key)
            return True

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            for key in [k for k, o in self._entries.items() if not o.pin_count]:
                self._drop_locked(key)

    def stats(self) -> dict[str, int | None]:
        return {**super().stats(), "entries": len(self._entries),
                "arena_used_bytes": self.allocator.used_bytes}

    def close(self) -> None:
        self.clear()
        super().close()
        if self.shared_segment is not None:
            self.shared_segment.close()
