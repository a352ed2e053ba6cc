"""Write-through to lower tiers through a bounded queue.

The engine never waits on a slow tier: each lower tier has one queue and one
writer thread. A full queue drops the write (counted on the tier as a
dropped write) instead of blocking. Queued chunks hold a reference, so the
buffer stays valid until the tier has it; while that reference is held, the
first tier cannot evict the chunk, so when it needs the room a chunk whose
write still waits in a queue is given up (``give_up_one``) rather than the new
store.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from lmkv.base import affinity
from lmkv.base.logutil import RateLimitedLog
from lmkv.contracts.tier import StorageBackend
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

# How long one lower-tier put may take before the writer moves on (the tier's
# own timeouts should end it sooner; this only bounds a hung tier).
PUT_TIMEOUT_S = 60.0
_order = itertools.count()  # submission order over every queue of the process


class WriteThrough:
    """One lower tier's queue and writer thread."""

    def __init__(self, tier: StorageBackend, max_chunks: int) -> None:
        self.tier = tier
        self.max_chunks = max_chunks
        # (order, keys, objs, parents) not yet taken by the writer, oldest first
        self._queue: deque[tuple[int, list, list, list]] = deque()
        self._pending = 0  # chunks queued or being written
        self._stopping = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"lmkv-write-{tier.name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
               parents: Sequence[CacheKey | None] | None = None) -> bool:
        """Queue a write (``parents``: as for ``StorageBackend.batched_submit_put``);
        False (and counted as dropped) when the queue is full or closed."""
        n = len(keys)
        with self._lock:
            if self._stopping:
                self.tier.counters.dropped_writes += n
                return False
            if self._pending + n > self.max_chunks:
                self.tier.counters.dropped_writes += n
                _log.warning(f"full:{self.tier.name}", "lmkv %s tier: write-through queue "
                             "full (%d chunks); dropping a write", self.tier.name,
                             self.max_chunks)
                return False
            self._pending += n
            for obj in objs:
                obj.ref_up()
            self._queue.append((next(_order), list(keys), list(objs),
                                [None] * n if parents is None else list(parents)))
            self._work.notify()
        return True

    @property
    def pending_chunks(self) -> int:
        return self._pending

    @property
    def oldest_queued(self) -> int | None:
        """The submission order of the oldest write not yet taken by the writer."""
        queued = self._queue
        try:
            return queued[0][0]
        except IndexError:
            return None

    def give_up_one(self, holders: int = 2) -> MemoryObj | None:
        """Give up one chunk's write that has not started (counted as dropped), so
        the first tier may evict the chunk: the first, oldest write first and its
        last chunk first (a prompt's tail, what a prefix-aware policy evicts
        first), whose buffer at most ``holders`` references hold (the tier that
        stores it, and this queue and the other lower tiers' ones) and no pin:
        anything more would keep it in memory. The chunk given up, or None when no
        such chunk waits."""
        with self._lock:
            for item in self._queue:
                objs = item[2]
                for i in range(len(objs) - 1, -1, -1):
                    obj = objs[i]
                    if obj.ref_count <= holders and not obj.pin_count:
                        self._drop_at(item, i)
                        return obj
        return None

    def give_up(self, obj: MemoryObj) -> bool:
        """Give up ``obj``'s write if it waits here (not started); whether it did."""
        with self._lock:
            for item in self._queue:
                for i, queued in enumerate(item[2]):
                    if queued is obj:
                        self._drop_at(item, i)
                        return True
        return False

    def _drop_at(self, item: tuple[int, list, list, list], i: int) -> None:
        """Under the lock: drop chunk ``i`` of the queued ``item``."""
        _, keys, objs, parents = item
        obj = objs[i]
        del keys[i], objs[i], parents[i]
        if not keys:
            self._queue.remove(item)
        obj.ref_down()
        self._pending -= 1
        self._idle.notify_all()
        self.tier.counters.dropped_writes += 1

    def _run(self) -> None:
        affinity.apply_background()
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._work.wait()
                if not self._queue:
                    return
                _, keys, objs, parents = self._queue.popleft()
            lineage = None if all(parent is None for parent in parents) else parents
            try:
                self.tier.batched_submit_put(keys, objs, parents=lineage).result(
                    timeout=PUT_TIMEOUT_S)
            except Exception as exc:  # the tier absorbs its faults; this is the last resort
                self.tier.faults.last_resort("write-through put", exc, "the writes are dropped")
            finally:
                for obj in objs:
                    obj.ref_down()
                with self._lock:
                    self._pending -= len(keys)
                    self._idle.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write reached the tier; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the writer; writes still queued after ``timeout`` are dropped."""
        self.flush(timeout)
        dropped = 0
        with self._lock:
            self._stopping = True
            for _, keys, objs, _ in self._queue:
                dropped += len(keys)
                for obj in objs:
                    obj.ref_down()
            self._queue.clear()
            self._pending -= dropped
            self._idle.notify_all()
            self._work.notify_all()
        self._thread.join(timeout=0.5)
        if dropped:
            self.tier.counters.dropped_writes += dropped
            logger.warning("lmkv %s tier: %d queued writes dropped at close", self.tier.name,
                           dropped)
