"""Write-through to lower tiers through a bounded queue.

The engine never waits on a slow tier: each lower tier has one queue and one
writer thread. A full queue drops the write (counted on the tier as a
dropped write) instead of blocking. Queued chunks hold a reference, so the
buffer stays valid until the tier has it; while that reference is held, the
first tier cannot evict the chunk, so when it needs the room a write still
waiting in a queue is given up (``cancel_oldest``) rather than the new store.
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
        self._queue: deque[tuple[int, list, list, list | None]] = deque()
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
        False (and counted as dropped) when the queue is full."""
        n = len(keys)
        with self._lock:
            if self._stopping or self._pending + n > self.max_chunks:
                self.tier.counters.dropped_writes += n
                _log.warning(f"full:{self.tier.name}", "lmkv %s tier: write-through queue "
                             "full (%d chunks); dropping a write", self.tier.name,
                             self.max_chunks)
                return False
            self._pending += n
            for obj in objs:
                obj.ref_up()
            self._queue.append((next(_order), list(keys), list(objs),
                                None if parents is None else list(parents)))
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

    def cancel_oldest(self) -> int:
        """Give up the oldest write not yet taken by the writer (counted as dropped):
        its references go, so the first tier may evict its chunks. Returns the
        chunks given up (0: nothing was waiting)."""
        with self._lock:
            if not self._queue:
                return 0
            _, keys, objs, _ = self._queue.popleft()
            self._pending -= len(keys)
            self._idle.notify_all()
        for obj in objs:
            obj.ref_down()
        self.tier.counters.dropped_writes += len(keys)
        return len(keys)

    def _run(self) -> None:
        affinity.apply_background()
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._work.wait()
                if not self._queue:
                    return
                _, keys, objs, parents = self._queue.popleft()
            try:
                self.tier.batched_submit_put(keys, objs, parents=parents).result(
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
        with self._lock:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._pending -= sum(len(keys) for _, keys, _, _ in left)
            self._work.notify_all()
        self._thread.join(timeout=0.5)
        dropped = 0
        for _, keys, objs, _ in left:
            dropped += len(keys)
            for obj in objs:
                obj.ref_down()
        if dropped:
            self.tier.counters.dropped_writes += dropped
            logger.warning("lmkv %s tier: %d queued writes dropped at close", self.tier.name,
                           dropped)
