"""The StorageBackend ABC: one tier of the cache.

A backend stores MemoryObjs (or their serialized frames) under CacheKeys.
Every method that can fail at run time (connection lost, corrupted value)
reports a miss for that key instead of raising into the engine's step, through
one policy: ``faults`` (``lmkv.contracts.faults.TierFaults``: counted errors, a breaker
for an unreachable storage) and ``drop_corrupt`` (a corrupt entry is a
counted, removed miss; ``decode_frame`` applies it to a frame).

Subclasses implement ``contains``, ``batched_submit_put``, ``get_blocking``,
``pin``, ``unpin``, ``remove`` and ``usage_bytes``. The batched lookup and the
non-blocking get have correct defaults built on those; a backend with a native
batch path (one dict pass, one Redis pipeline) overrides them.
"""

from __future__ import annotations

import enum
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from lmkv.base import affinity
from lmkv.base.errors import CorruptFrameError
from lmkv.base.futures import Finished
from lmkv.contracts.faults import TierCounters, TierFaults
from lmkv.contracts.plugin import OptionsArg, Plugin
from lmkv.contracts.policy import EvictionPolicy
from lmkv.contracts.serde import Serializer, read_header
from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryAllocator, MemoryObj

if TYPE_CHECKING:
    from lmkv.memory.shm import SharedSegment

logger = logging.getLogger(__name__)


def done_future(value: object) -> Future:
    """A future already finished with ``value``."""
    return Finished(value)


class ArenaPlacement(enum.Enum):
    """Where a tier that holds memory (``holds_memory_objs``) places its arena."""

    #: This process's own memory.
    PRIVATE = "private"
    #: A named shared-memory segment (``lmkv.memory.shm``) that other processes on
    #: this machine map: the ``lmkv server`` asks it of its first memory tier, so
    #: clients copy chunks straight in and out. A preference: a tier that cannot
    #: get a segment warns and stays private, unless its own options demand one.
    SHARED = "shared"


@dataclass(frozen=True)
class BackendContext:
    """What lmkv hands a backend besides its own options (``cls(options, context)``)."""

    #: Turns chunks into frames and back, for tiers that store bytes.
    serializer: Serializer | None = None
    #: Orders this tier's keys for eviction, for tiers that evict.
    eviction_policy: EvictionPolicy | None = None
    #: Where deserialized chunks go: buffers of the tier that holds memory
    #: (``holds_memory_objs``: the cpu tier's arena), whatever its place in
    #: ``tiers``; a call answers None when no room can be made. That tier is
    #: built first, so a constructor may already call it; in tiers built from a
    #: config, the storage manager answers the calls once it is made, and may
    #: give up chunk writes still queued for lower tiers to make room. Plain
    #: tensors when no tier holds memory; the field is None for the tier that
    #: holds memory itself (it allocates from its own arena).
    allocate: Allocate | None = None
    #: This tier's position in ``tiers`` (for messages: ``tiers.<i>.options``).
    tier_index: int = 0
    #: Where a tier that holds memory places its arena.
    arena: ArenaPlacement = ArenaPlacement.PRIVATE
    #: Built by ``lmkv config check`` to see that it can be: check the options
    #: and what is cheap to check, acquire nothing that depends on this machine
    #: at this moment (an arena the size of ``max_bytes``); ``close`` follows at
    #: once and no other method is called.
    dry_run: bool = False
    #: The tier that holds memory (``holds_memory_objs``, built first), for a
    #: tier that serves what it holds to other instances (the ``peer`` tier);
    #: None for that tier itself and where no tier holds memory. Use its
    #: thread-safe calls only (``contains``, ``get_blocking``, ``unpin``,
    #: ``allocate``, ``batched_submit_put``, ``batched_async_contains``,
    #: ``remove``, ``decode``), and never ``close`` it. Since storage_backend 2.3.
    memory: StorageBackend | None = None


class TrackedAllocate:
    """``allocate`` that remembers what it handed out, so a decode that fails or
    returns something else gives every buffer back (no arena block leaks,
    whatever a serializer does with a crafted frame)."""

    __slots__ = ("_allocate", "_objs")

    def __init__(self, allocate: Allocate | None) -> None:
        self._allocate = allocate
        self._objs: list[MemoryObj] = []

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        if self._allocate is None:
            return None
        obj = self._allocate(shape, dtype)
        if obj is not None:
            self._objs.append(obj)
        return obj

    def release_all(self) -> None:
        objs, self._objs = self._objs, []
        for obj in objs:
            obj.ref_down()

    def keep_only(self, result: object) -> CorruptFrameError | None:
        """Keep ``result`` (the decoded chunk) and release every other buffer; a
        result that is not a whole chunk from this allocation is released too and
        reported as a corrupt frame. None (no room) is a plain miss."""
        if result is None:
            self.release_all()
            return None
        kept = next((o for o in self._objs if o is result), None)
        problem = None
        if kept is None:
            problem = CorruptFrameError("the serializer returned a buffer it did not allocate")
        elif kept.tensor.numel() == 0:
            problem = CorruptFrameError(f"frame holds no elements (shape {tuple(kept.shape)})")
        else:
            self._objs.remove(kept)
        self.release_all()
        return problem


class StorageBackend(Plugin, ABC):
    """One storage tier. See plugins.md, "StorageBackend", for the full contract."""

    #: True when entries live as MemoryObjs in this process (no serializer needed).
    holds_memory_objs: bool = False
    #: True when ``batched_async_contains`` answers without the network or another
    #: thread (from memory, at most a stat of a local file) and the batched gets
    #: return without waiting for a payload (their reads run on the tier's own
    #: threads; a direct get may open entries already in the page cache): the
    #: storage manager may then look up on the caller's thread instead of
    #: handing the lookup to a prefetch thread. Taken from a class written for
    #: API 2.2 or later only (a subclass of the cpu or fs tier written for an
    #: earlier one does not inherit it).
    lookups_in_memory: bool = False
    #: The arena of a tier that holds memory (``holds_memory_objs``), else None.
    allocator: MemoryAllocator | None = None
    #: The shared-memory segment the arena lives in, when it does (``lmkv server``).
    shared_segment: SharedSegment | None = None

    def __init__(self, options: OptionsArg = None, context: BackendContext | None = None) -> None:
        self.options = self.parse_options(options)
        self.context = BackendContext() if context is None else context
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self.counters = TierCounters()

    # -- required --------------------------------------------------------
    @abstractmethod
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        """Whether ``key`` is stored; with ``pin``, a hit is pinned atomically."""

    @abstractmethod
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        """Start storing ``objs`` under ``keys``; the future resolves to the number stored.

        ``parents[i]`` is the key ``keys[i]`` extends (the chunk before it in its
        prompt; None for a first chunk), or ``parents`` is None when unknown. A
        tier that evicts hands each to its policy (``EvictionPolicy.insert``), so
        it evicts leaves first and never orphans a prefix.

        The backend takes its own reference on each object for as long as it needs
        it; the caller may release its references as soon as this returns.
        """

    @abstractmethod
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        """The chunk under ``key`` with a reference owned by the caller, or None."""

    @abstractmethod
    def pin(self, key: CacheKey) -> bool:
        """Protect ``key`` from eviction; False when it is not stored."""

    @abstractmethod
    def unpin(self, key: CacheKey) -> bool:
        """Undo one ``pin``; False when it is not stored."""

    @abstractmethod
    def remove(self, key: CacheKey) -> bool:
        """Drop ``key``; False when it was not stored.

        Pins protect against eviction. A tier may refuse to remove a pinned
        entry (the cpu tier does, since a lookup is about to read its buffer);
        a tier that stores frames removes it, so a corrupt entry always goes.
        """

    @property
    @abstractmethod
    def usage_bytes(self) -> int:
        """Bytes this tier holds now."""

    # -- defaults a backend may override ---------------------------------
    @property
    def capacity_bytes(self) -> int | None:
        """The tier's byte budget, or None when it has none."""
        return None

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A chunk buffer from this tier's memory, evicting as needed.

        Only tiers that hold MemoryObjs (``holds_memory_objs``) own memory to
        hand out; the others return None.
        """
        return None

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        """How many of the LEADING keys are stored (stop at the first miss).

        With ``pin``, each counted key is pinned; the caller unpins them.
        """
        hits = 0
        for key in keys:
            if not self.contains(key, pin=pin):
                break
            hits += 1
        return hits

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        """Start fetching ``keys``; resolves to the leading objects found (a prefix).

        Each returned object carries a reference owned by the caller.
        """
        return self._background(self._get_prefix, list(keys))

    def batched_get_direct(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future | None:
        """``batched_get_non_blocking`` for a caller that reads chunks itself: the
        leading objects found, each a ``lmkv.contracts.direct_chunk.DirectChunk`` (left in the
        tier, read on demand) or a MemoryObj (read in anyway: an alias, say).
        None (the default): this tier always reads chunks in; the caller then
        uses ``batched_get_non_blocking``."""
        return None

    def _get_prefix(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        out: list[MemoryObj] = []
        for key in keys:
            obj = self.get_blocking(key)
            if obj is None:
                break
            out.append(obj)
        return out

    def _background(self, fn: Callable, *args: object) -> Future:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"lmkv-{self.name}",
                    initializer=affinity.apply)
            return self._executor.submit(fn, *args)

    # -- the fault policy (lmkv.contracts.faults) -------------------------------------
    @cached_property
    def faults(self) -> TierFaults:
        """This tier's fault policy: what it absorbs, its breaker, its fault log.

        The default absorbs I/O errors (OSError) and opens the breaker on
        ``TierUnavailable``; anything else raises out of the tier (a bug must
        show; the storage manager's last resort logs it). A tier declares its own
        view (its storage library's errors, which of them mean the server is
        gone, a longer backoff, secrets to mask) by assigning its own
        ``TierFaults`` in ``__init__``.
        """
        return TierFaults(self.counters, f"{self.name} tier",
                          log=logging.getLogger(type(self).__module__))

    def drop_corrupt(self, key: CacheKey, problem: object) -> None:
        """The one way a corrupt entry ends: counted in ``corrupt_frames``, logged
        at a bounded rate and removed from the tier. The get that found it
        counts its miss as for any other miss."""
        self.faults.corrupt(key.to_string(), problem)
        self.remove(key)

    def decode(self, key: CacheKey, frame: bytes | bytearray | memoryview,
               allocate: Allocate | None = None) -> MemoryObj | None:
        """Deserialize a stored frame into a buffer from ``allocate`` (by default
        ``context.allocate``; the tier that holds memory passes its own ``allocate``).

        Returns None when there is no memory to decode into; raises
        ``CorruptFrameError`` for a frame that fails to decode or verify, is bound
        to another key, or decodes to something else than its header says (the
        serializer may raise anything on a crafted frame: that is corrupt too).
        Every buffer the decode took is given back on failure.
        """
        serializer = self.context.serializer
        if serializer is None:
            # A bug in how the tier was built, not a bad frame: the frame stays.
            raise TypeError(f"{type(self).__name__}.decode needs a serializer "
                            "(context.serializer is None)")
        taken = TrackedAllocate(allocate or self.context.allocate)
        try:
            # Bound to its key and of a sane shape whatever the serializer checks.
            header = read_header(memoryview(frame).cast("B"), key)
            obj = serializer.deserialize(frame, taken, key)
            problem = taken.keep_only(obj)
            if problem is None and obj is not None and (
                    obj.dtype != header.dtype or tuple(obj.shape) != header.shape):
                obj.ref_down()
                problem = CorruptFrameError(f"decoded to {obj.dtype} {list(obj.shape)}, the "
                                            f"header says {header.dtype} {list(header.shape)}")
        except CorruptFrameError:
            taken.release_all()
            raise
        except Exception as exc:
            taken.release_all()
            raise CorruptFrameError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            taken.release_all()
            raise
        if problem is not None:
            raise problem
        return obj

    def decode_frame(self, key: CacheKey, frame: bytes | bytearray | memoryview
                     ) -> MemoryObj | None:
        """``decode``, with a corrupt frame dropped (``drop_corrupt``): None is a
        miss (corrupt frame, or no memory to decode into), never wrong data."""
        try:
            return self.decode(key, frame)
        except CorruptFrameError as exc:
            self.drop_corrupt(key, exc)
            return None

    def stats(self) -> dict[str, int | None]:
        """Counters (``TierCounters``), usage and capacity; backends may add their own."""
        return {**self.counters.as_dict(), "usage_bytes": self.usage_bytes,
                "capacity_bytes": self.capacity_bytes,
                # 0 while the breaker is open (the tier answers misses): /health reads it
                "available": int(not self.faults.breaker.is_open)}

    def close(self) -> None:
        """Release resources; must return promptly even when a remote is unreachable."""
        self.faults.close()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
