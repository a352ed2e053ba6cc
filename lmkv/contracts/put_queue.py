"""Asynchronous puts for a remote tier: a bounded queue and one writer thread.

A tier whose puts cross a network (Redis, Mooncake, ...) must never make the
engine wait for them and never hold more than a bound of chunk memory while
they are on their way. ``PutQueue.submit`` takes a reference on every
MemoryObj and returns a future at once; one background thread runs the
tier's ``_write`` for the batch, then the references are released. A batch
that would pass ``max_pending_bytes``, or comes while the tier is closing or
unusable (its breaker open), is dropped and counted as dropped writes. The
future resolves to the number of entries stored and never raises for a tier
fault (``_write`` handles those); an exception out of ``_write`` is a bug
and is passed on.

Tier plugins subclass it with their ``usable`` and ``_write``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

from lmkv.base import affinity
from lmkv.contracts.faults import TierFaults
from lmkv.contracts.tier import done_future
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj


class PutQueue(ABC):
    def __init__(self, faults: TierFaults, max_pending_bytes: int, thread_name: str) -> None:
        self.faults = faults
        self.counters = faults.counters
        self.max_pending_bytes = max_pending_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name,
                                            initializer=affinity.apply)
        self._lock = threading.Lock()
        self._in_flight: set[Future] = set()
        self.pending_bytes = 0  # bytes of batches submitted and not finished
        self.net_bytes = 0  # bytes stored less bytes forgotten (the tier's usage)
        self._closing = False

    @property
    @abstractmethod
    def usable(self) -> bool:
        """Whether the tier takes puts now (False while its breaker is open)."""

    @abstractmethod
    def _write(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        """Store the batch (on the writer thread); the number of entries stored.
        Tier faults are handled here, never raised."""

    def forget(self, nbytes: int) -> None:
        with self._lock:
            self.net_bytes -= nbytes

    def submit(self, keys: list[CacheKey], objs: list[MemoryObj]) -> Future:
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys for {len(objs)} chunks")
        if not keys:
            return done_future(0)
        nbytes = sum(obj.nbytes for obj in objs)
        with self._lock:
            full = self.pending_bytes and (
                self.pending_bytes + nbytes > self.max_pending_bytes)
            accepted = not full and not self._closing and self.usable
            if accepted:
                self.pending_bytes += nbytes
        if not accepted:
            self.counters.dropped_writes += len(keys)
            if full:
                self.faults.note("queue-full", "%d bytes of puts still pending; dropping %d "
                                 "writes", self.pending_bytes, len(keys))
            return done_future(0)
        for obj in objs:
            obj.ref_up()
        result: Future = Future()
        try:
            job = self._executor.submit(self._write, keys, objs)
        except RuntimeError:  # closed meanwhile
            job = Future()
            job.cancel()
        with self._lock:
            self._in_flight.add(job)
        job.add_done_callback(partial(self._finished, objs, nbytes, result))
        return result

    def _finished(self, objs: list[MemoryObj], nbytes: int, result: Future, job: Future) -> None:
        for obj in objs:
            obj.ref_down()
        with self._lock:
            self.pending_bytes -= nbytes
            self._in_flight.discard(job)
        if job.cancelled():
            self.counters.dropped_writes += len(objs)
            result.set_result(0)
        elif job.exception() is not None:  # a bug, not a tier fault: let it show
            result.set_exception(job.exception())
        else:
            result.set_result(job.result())

    def close(self, timeout_s: float) -> None:
        """Refuse new puts; give those in flight ``timeout_s`` to finish, cancel the rest."""
        with self._lock:
            self._closing = True
            in_flight = list(self._in_flight)
        if in_flight and timeout_s > 0:
            wait(in_flight, timeout=timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
