"""Write-through to lower tiers through a bounded queue.

The engine never waits on a slow tier: each lower tier has one queue and one
writer thread. A full queue drops the write (counted on the tier as a
dropped write) instead of blocking. Queued chunks hold a reference, so the
buffer stays valid until the tier has it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from lmkv.base import affinity
from lmkv.base.logutil import RateLimitedLog
from lmkv.contracts.tier import StorageBackend
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

_STOP = object()
# How long one lower-tier put may take before the writer moves on (the tier's
# own timeouts should end it sooner; this only bounds a hung tier).
PUT_TIMEOUT_S = 60.0


class WriteThrough:
    """One lower tier's queue and writer thread."""

    def __init__(self, tier: StorageBackend, max_chunks: int) -> None:
        self.tier = tier
        self.max_chunks = max_chunks
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # chunks queued or being written
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=f"lmkv-write-{tier.name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
               parents: Sequence[CacheKey | None] | None = None) -> bool:
        """Queue a write (``parents``: as for ``StorageBackend.batched_submit_put``);
        False (and counted as dropped) when the queue is full."""
        n = len(keys)
        with self._lock:
            if self._pending + n > self.max_chunks:
                self.tier.counters.dropped_writes += n
                _log.warning(f"full:{self.tier.name}", "lmkv %s tier: write-through queue "
                             "full (%d chunks); dropping a write", self.tier.name,
                             self.max_chunks)
                return False
            self._pending += n
        for obj in objs:
            obj.ref_up()
        self._queue.put((list(keys), list(objs), None if parents is None else list(parents)))
        return True

    @property
    def pending_chunks(self) -> int:
        return self._pending

    def _run(self) -> None:
        affinity.apply_background()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            keys, objs, parents = item
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
        self._queue.put(_STOP)
        self._thread.join(timeout=0.5)
        dropped = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                continue
            keys, objs, _ = item
            dropped += len(keys)
            for obj in objs:
                obj.ref_down()
        if dropped:
            self.tier.counters.dropped_writes += dropped
            logger.warning("lmkv %s tier: %d queued writes dropped at close", self.tier.name,
                           dropped)
