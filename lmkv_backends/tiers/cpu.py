"""The ``cpu`` tier: chunk buffers kept in one host-memory arena.

A full arena evicts unpinned, unreferenced entries in the order of the tier's
eviction policy and never allocates past ``max_bytes``.

The index is compact, so that hundreds of thousands of small chunks cost
little besides their bytes: keys are numbered by slot (``SlotKeys``: the
chunk hash in a dict per meta, the caller's CacheKey is not kept), and an
entry is its arena offset, size and layout in arrays by slot. An entry has
a MemoryObj only while someone else holds a reference to it, or a pin (kept
in ``_live``; a sweep lets go of those back to the tier's reference alone).
A policy that orders slots (every built-in one) is handed slots, and
``lru`` keeps its order in arrays too; any other policy is handed keys, as
every tier does.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future
from itertools import repeat
from typing import Annotated

import torch
from pydantic import ByteSize, Field, field_validator
from pydantic_core import PydanticCustomError

from lmkv.base.errors import ConfigError
from lmkv.base.units import ByteCount
from lmkv.contracts.plugin import OptionsArg, PluginOptions
from lmkv.contracts.policy import EvictionPolicy
from lmkv.contracts.tier import ArenaPlacement, BackendContext, StorageBackend, done_future
from lmkv.keys.chunking import CacheKey
from lmkv.keys.slots import SlotKeys
from lmkv.memory import (
    Layout,
    MemoryAllocator,
    MemoryObj,
    add_refs,
    nbytes_of,
    or_else,
    owned,
)
from lmkv.memory.shm import SharedMemoryUnavailable, SharedSegment, available_memory_bytes

logger = logging.getLogger(__name__)

#: A ceiling for ``prefault_ahead`` where it is turned on: a 4096-token Llama-3-8B
#: bf16 prefix.
PREFAULT_AHEAD = 512 << 20
#: The largest ``max_bytes``: more than a 64-bit process can map (x86-64's 57-bit
#: addresses), so anything past it is a slip, and its figures stay readable.
MAX_ARENA_BYTES = 64 << 50
#: Entries with a MemoryObj before the tier looks for ones back to its own reference.
_SWEEP_MIN = 4096


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
    (or stored) land on pages that are already there. Unset or 0: off (the
    default: inside an engine that keeps every CPU busy, a CPU build of vLLM,
    the faulting lands in the next requests; see docs/tiers/cpu.md). A
    suggested size where CPUs are to spare: ``max_bytes / 16``, at most
    ``PREFAULT_AHEAD``."""
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
    api_version = "2.2"
    Options = CPUOptions
    options: CPUOptions
    holds_memory_objs = True
    lookups_in_memory = True

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
        self._lock = threading.Lock()
        self._stored_bytes = 0
        self._count = 0
        self._keys = SlotKeys()
        # Per slot: arena offset in units of the alignment (-1: not stored), and the
        # layout's number (-1: in _odd); the size follows from the layout.
        self._align = self.allocator.alignment
        self._offset = array("i" if self.allocator.capacity_bytes // self._align < 2**31
                             else "q")
        self._ident = array("h")
        self._odd: dict[int, Layout] = {}  # slot -> a layout the allocator did not intern
        self._live: dict[int, MemoryObj] = {}  # entries held elsewhere too, or pinned
        self._sweep_at = _SWEEP_MIN
        self._by_slot = self.policy.orders_slots
        if self._by_slot:
            self.policy.order_slots(self._keys.key)
        if type(self).allocate is CPUBackend.allocate:  # (one call on the common path)
            self.allocate = or_else(self.allocator.fast_allocate,  # type: ignore[method-assign,assignment]
                                    self._allocate_locked)

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
                prefault_ahead=int(ahead) if ahead is not None else 0)
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
        return self._count

    # -- the index ---------------------------------------------------------
    def _stored(self, key: CacheKey) -> int:
        """``key``'s slot when it is stored here, else -1."""
        slot = self._keys.slot(key)
        return -1 if slot is None or self._offset[slot] < 0 else slot

    def _layout(self, slot: int) -> Layout:
        """A stored entry's layout (its dtype, shape and arena bytes)."""
        ident = self._ident[slot]
        return self.allocator.interned_layout(ident) if ident >= 0 else self._odd[slot]

    def _obj(self, slot: int) -> MemoryObj:
        """The entry's MemoryObj (made, holding the tier's reference, when it has
        none), kept in ``_live`` until a sweep finds it back to that reference."""
        obj = self._live.get(slot)
        if obj is None:
            obj = self.allocator.reuse(self._offset[slot] * self._align, self._layout(slot))
            self._live[slot] = obj
        return obj

    def _size(self, slot: int) -> int:
        """The arena bytes of a stored entry."""
        return self._layout(slot).size

    def _sweep(self) -> None:
        """Let go of the MemoryObjs only the tier holds (one reference, no pin): the
        entry is its offset again. Amortized: run when ``_live`` doubled."""
        live = self._live
        if len(live) < self._sweep_at:
            return
        for slot in [s for s, o in live.items() if o.ref_count == 1 and not o.pin_count]:
            del live[slot]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(live))

    def _evictable(self, slot: int) -> bool:
        obj = self._live.get(slot)
        return obj is None or obj.is_evictable

    def _policy_parent(self, parent: CacheKey | None) -> Hashable | None:
        """The parent as the policy names it: a policy ordering slots gets one for a
        parent not stored here too (released when nothing stored extends it)."""
        if parent is None or not self._by_slot:
            return parent
        slot = self._keys.add(parent)
        if slot == len(self._offset):
            self._offset.append(-1)
            self._ident.append(-1)
        return slot

    def _slot_of(self, name: Hashable) -> int:
        """A slot from what the policy names (-1: not a stored entry of this tier)."""
        slot = self._keys.slot_named(name, self._by_slot)
        return slot if slot >= 0 and self._offset[slot] >= 0 else -1

    def _release_slot(self, slot: int) -> None:
        """``slot`` names nothing stored: give it back unless a stored entry still
        names it as its parent (a policy ordering slots counts that)."""
        if self._offset[slot] >= 0:
            return
        if self._by_slot and self.policy.lineage.children(slot):
            return
        self._keys.remove(slot)
        self._odd.pop(slot, None)

    # -- memory ----------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer from this tier's arena, evicting as needed; None when nothing can go.
        (Each tier's own is its arena's allocate, then ``_allocate_locked``, in one
        call: set in ``__init__`` unless a subclass has its own.)"""
        obj = self.allocator.allocate(shape, dtype)
        if obj is not None:
            return obj
        return self._allocate_locked(shape, dtype)

    def _allocate_locked(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        with self._lock:
            return self._allocate_evicting(shape, dtype)

    def _allocate_evicting(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer, evicting to make room: asked after an allocation failed."""
        size = nbytes_of(shape, dtype)
        if size > self.allocator.capacity_bytes:
            return None
        reused = self._reuse_victim(shape, dtype)
        if reused is not None:
            return reused
        rounds = 0
        while True:
            # Asked after an allocation failed: make room first, then allocate.
            if rounds == 1 and not self._could_fit(size):
                return None  # fragmented around pinned or referenced entries
            if not self._evict_locked(max(1, size - self.allocator.largest_free_block)):
                return self.allocator.allocate(shape, dtype)  # freed meanwhile, or None
            obj = self.allocator.allocate(shape, dtype)
            if obj is not None:
                return obj
            rounds += 1

    def _reuse_victim(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A full arena of uniform chunks, the common case: when the policy's first
        evictable victim is a chunk of this layout that nobody holds, it is evicted
        and its bytes become the new buffer (no free, no search for a block).
        None otherwise (nothing evicted: the general path takes over)."""
        try:
            layout = self.allocator.layout(shape, dtype)
        except ValueError:
            return None
        if layout.ident < 0:
            return None
        slot = next(self._victims(), -1)
        if slot < 0 or self._ident[slot] != layout.ident:
            return None
        offset = self._offset[slot] * self._align
        taken = self._drop_locked(slot, free=False)
        self.counters.evictions += 1
        # (its MemoryObj, when it had one: the tier's reference is the caller's now)
        return taken if taken is not None else self.allocator.reuse(offset, layout)

    def _could_fit(self, size: int) -> bool:
        """Whether evicting every evictable entry would leave a contiguous block of ``size``.

        Only asked when an eviction did not make room (odd sizes, pinned neighbours):
        with uniform chunks the first eviction always does.
        """
        blocks = self.allocator.free_blocks()
        align = self._align
        blocks += [(self._offset[s] * align, self._size(s)) for s in self._stored_slots()
                   if self._evictable(s)]
        blocks.sort()
        run_start, run_end = -1, -1
        for start, length in blocks:
            if start != run_end:
                run_start = start
            run_end = start + length
            if run_end - run_start >= size:
                return True
        return False

    def _stored_slots(self) -> Iterator[int]:
        offsets = self._offset
        return (slot for slot in self._keys.slots() if offsets[slot] >= 0)

    def _victims(self) -> Iterator[int]:
        """Stored slots that no one else holds or pins, in the policy's eviction
        order (drop one only after the iteration ends)."""
        live, by_slot, offsets = self._live, self._by_slot, self._offset
        for name in self.policy.candidates():
            if by_slot:  # the policy orders only this tier's keys
                slot = name if type(name) is int and offsets[name] >= 0 else -1
            else:
                slot = self._slot_of(name)
            if slot < 0:
                continue
            obj = live.get(slot)
            if obj is None or obj.is_evictable:
                yield slot

    def _evict_locked(self, needed: int) -> int:
        """Evict unpinned, unreferenced entries in policy order; returns bytes freed."""
        victims: list[int] = []
        freed = 0
        for slot in self._victims():
            victims.append(slot)
            freed += self._size(slot)
            if freed >= needed:
                break
        for slot in victims:
            self._drop_locked(slot)
        self.counters.evictions += len(victims)
        return freed

    def _drop_locked(self, slot: int, free: bool = True) -> MemoryObj | None:
        """Forget ``slot``'s entry and give its bytes back. ``free`` false: the
        caller takes them over (an entry nobody else holds): its MemoryObj, with
        the tier's reference, is returned when it has one."""
        size = self._size(slot)
        self._stored_bytes -= size
        self._count -= 1
        obj = self._live.pop(slot, None)
        taken = None
        if obj is not None:
            if free:
                obj.ref_down()  # the tier's reference (a reader may hold more)
            else:
                taken = obj
        elif free:
            self.allocator.free_block(self._offset[slot] * self._align, size)
        self._offset[slot] = -1
        self._odd.pop(slot, None)
        if not self._by_slot:
            self.policy.forget(self._keys.key(slot))
            self._keys.remove(slot)
            self._odd.pop(slot, None)
            return taken
        lineage = self.policy.lineage
        parent = lineage.parent(slot)
        self.policy.forget(slot)
        if not lineage.children(slot):  # no stored entry names it as its parent
            self._keys.remove(slot)
            self._odd.pop(slot, None)
        if parent is not None:
            self._release_slot(parent)  # type: ignore[arg-type]  # a slot: by_slot
        return taken

    # -- contract ----------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            if pin:
                self._obj(slot).pin()
            return True

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        hits = 0
        with self._lock:
            for key in keys:
                slot = self._stored(key)
                if slot < 0:
                    break
                if pin:
                    self._obj(slot).pin()
                hits += 1
        return hits

    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        stored = 0
        lineage = parents if parents is not None else [None] * len(keys)
        with self._lock:
            self._sweep()
            allocator = self.allocator
            if self._by_slot and owned(objs, allocator):
                return done_future(self._put_own(keys, objs, lineage))
            policy, slots, live = self.policy, self._keys, self._live
            offsets, idents, align = self._offset, self._ident, self._align
            by_slot = self._by_slot
            last_key: CacheKey | None = None
            last_slot = -1
            for key, obj, parent in zip(keys, objs, lineage, strict=True):
                if obj._allocator is not allocator:
                    # Copied in first: making room may evict (and give slots back),
                    # so no slot is claimed while it runs.
                    if self._stored(key) >= 0:
                        continue
                    copy = allocator.allocate(obj.shape, obj.dtype)
                    if copy is None:
                        copy = self._allocate_evicting(obj.shape, obj.dtype)
                        # Making room may have evicted the chunk stored just before
                        # (and given its slot back): name the parent by its key again.
                        last_key = None
                    if copy is None:
                        self.counters.dropped_writes += 1
                        continue
                    try:
                        copy.tensor.copy_(obj.tensor)
                    except BaseException:
                        copy.ref_down()
                        raise
                    obj = copy  # its one reference is the tier's
                elif not obj.ref_up():
                    continue  # a released buffer: never store it
                slot = slots.add(key)  # its own, or a new one
                if slot == len(offsets):
                    offsets.append(-1)
                    idents.append(-1)
                elif offsets[slot] >= 0:
                    obj.ref_down()  # stored already: the reference taken goes back
                    continue
                layout = obj._layout
                offsets[slot] = obj.offset // align
                idents[slot] = layout.ident
                if layout.ident < 0:
                    self._odd[slot] = layout
                live[slot] = obj
                if not by_slot:
                    policy.insert(key, parent)
                elif parent is None:
                    policy.insert(slot, None)
                elif parent is last_key:  # a prompt's chunks in order: the one before
                    policy.insert(slot, last_slot)
                else:
                    policy.insert(slot, self._policy_parent(parent))
                last_key, last_slot = key, slot
                # Counted as each lands: a later item that raises leaves these right.
                self._stored_bytes += obj.nbytes
                self._count += 1
                self.counters.bytes_in += obj.nbytes
                self.counters.puts += 1
                stored += 1
        return done_future(stored)

    def _put_own(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                 parents: Sequence[CacheKey | None]) -> int:
        """The common batch (under the lock): every buffer of this tier's arena and
        live, slots ordered by the policy. The same steps as the general loop,
        each for the whole batch: the keys' slots, the records (each with the
        tier's reference, taken as it is recorded) and the policy's inserts."""
        index, offsets = self._keys, self._offset
        try:
            slots = index.add_many(keys)  # their own, or new ones
        except BaseException:
            self._give_back(keys)  # the slots given before the key that failed
            raise
        self._reach_slots()
        out: list = [[], [], [], [0]]
        new, new_parents, unresolved, tally = out
        failure: BaseException | None = None
        try:
            _record_puts(list(keys), list(objs), slots, list(parents), offsets, self._ident,
                         self._odd, self._live, self._align, out)
        except BaseException as exc:  # what was recorded before it is ordered below
            failure = exc
        # What landed is ordered and counted, even past an item that raised.
        for at, item in unresolved:  # a parent other than the chunk before
            try:
                new_parents[at] = self._policy_parent(parents[item])
            except BaseException as exc:  # stored as a root, as its own prompt's head
                failure = failure or exc
        self._stored_bytes += tally[0]
        self._count += len(new)
        self.counters.bytes_in += tally[0]
        self.counters.puts += len(new)
        try:
            # the base's, whatever a policy written for an earlier API calls its own
            EvictionPolicy.insert_many(self.policy, new, new_parents)
        finally:
            if len(new) < len(slots):  # stored already, or not stored: slots unused
                for slot in slots:
                    self._release_slot(slot)
        if failure is not None:
            raise failure
        return len(new)

    def _reach_slots(self) -> None:
        """The arrays by slot hold every slot the index has given."""
        more = self._keys.capacity - len(self._offset)
        if more > 0:
            self._offset.extend(repeat(-1, more))
            self._ident.extend(repeat(-1, more))

    def _give_back(self, keys: Sequence[CacheKey]) -> None:
        """The slots of ``keys`` that hold nothing stored, given back (after a batch
        that failed while it claimed them)."""
        self._reach_slots()
        for key in keys:
            try:
                slot = self._keys.slot(key)
            except Exception:  # the key that failed: it has none
                continue
            if slot is not None:
                self._release_slot(slot)

    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                self.counters.misses += 1
                return None
            obj = self._obj(slot)
            obj.ref_up()
            self.policy.access(slot if self._by_slot else key)
            self.counters.hits += 1
            self.counters.bytes_out += obj.nbytes
            return obj

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        out: list[MemoryObj] = []
        got_bytes = 0
        with self._lock:
            self._sweep()
            index, live, offsets = self._keys, self._live, self._offset
            found: list[int] = []
            for key in keys:
                slot = index.slot(key)
                if slot is None or offsets[slot] < 0:
                    break
                obj = live.get(slot)
                if obj is None:
                    obj = self._obj(slot)
                found.append(slot)
                out.append(obj)
                got_bytes += obj.nbytes
            EvictionPolicy.access_many(self.policy,
                                       found if self._by_slot else keys[:len(found)])
            # The readers' references, in one call: each entry holds the tier's (it
            # is stored, and the tier's lock is held), so none of these buffers
            # can have been released.
            add_refs(out)
            self.counters.hits += len(out)
            self.counters.misses += len(keys) - len(out)
            self.counters.bytes_out += got_bytes
        return done_future(out)

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            self._obj(slot).unpin()
            return True

    def remove(self, key: CacheKey) -> bool:
        """Drop ``key``; a pinned entry is protected and stays (returns False). A
        reader still holding it keeps its buffer until it gives it back."""
        with self._lock:
            slot = self._stored(key)
            if slot < 0:
                return False
            obj = self._live.get(slot)
            if obj is not None and obj.pin_count:
                return False
            self._drop_locked(slot)
            return True

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            live = self._live
            for slot in list(self._stored_slots()):
                obj = live.get(slot)
                if obj is None or not obj.pin_count:
                    self._drop_locked(slot)

    def eviction_candidates(self) -> list[CacheKey]:
        """The keys the policy would evict first first (leaves only), whatever it
        names them by."""
        with self._lock:
            slots = [self._slot_of(name) for name in self.policy.candidates()]
            return [self._keys.key(slot) for slot in slots if slot >= 0]

    def entry_refs(self) -> list[tuple[int, int]]:
        """(references, pins) of every entry, the tier's own reference included
        (for tests: an entry nobody else holds is ``(1, 0)``)."""
        with self._lock:
            out = []
            for slot in self._stored_slots():
                obj = self._live.get(slot)
                out.append((1, 0) if obj is None else (obj.ref_count, obj.pin_count))
            return out

    def stats(self) -> dict[str, int | None]:
        return {**super().stats(), "entries": self._count,
                "arena_used_bytes": self.allocator.used_bytes}

    def close(self) -> None:
        self.clear()
        super().close()
        if self.shared_segment is not None:
            self.shared_segment.close()


def _record_puts_py(keys: list[CacheKey], objs: list[MemoryObj], slots: list[int],
                    parents: list[CacheKey | None], offsets: array, idents: array,
                    odd: dict[int, Layout], live: dict[int, MemoryObj], align: int,
                    out: list) -> None:
    """``lmkv._ext._memory.record_puts`` where the accelerator is not built: the
    same records, item by item (see ``CPUBackend._put_own``)."""
    new, new_parents, unresolved, tally = out
    last: CacheKey | None = None
    last_slot = -1
    for i, (key, obj, slot, parent) in enumerate(zip(keys, objs, slots, parents, strict=True)):
        if offsets[slot] >= 0:
            continue  # stored already
        if obj.ref_count <= 0:
            obj.ref_up()  # a released buffer, never stored: reported there
            continue
        layout = obj._layout
        resolve = parent is not None and (last is None or parent is not last)
        new.append(slot)
        new_parents.append(last_slot if parent is not None and not resolve else None)
        try:
            if resolve:
                unresolved.append((len(new) - 1, i))
            live[slot] = obj
            if layout.ident < 0:
                odd[slot] = layout
        except BaseException:  # this item is undone whole, as the C one does
            if live.get(slot) is obj:
                del live[slot]
            if resolve and unresolved and unresolved[-1] == (len(new) - 1, i):
                unresolved.pop()
            new.pop()
            new_parents.pop()
            raise
        offsets[slot] = obj.offset // align
        idents[slot] = layout.ident
        obj.ref_up()  # the tier's
        tally[0] += obj.nbytes
        last, last_slot = key, slot


try:
    from lmkv._ext._memory import record_puts as _record_puts
except ImportError:  # pragma: no cover - depends on the build
    _record_puts = _record_puts_py
