"""Tiered lookup-and-prefetch: the weighted semaphore, the per-lookup tasks and
the event manager that hands results from storage threads to the caller.

Semantics (docs/storage.md, "Tiers and the storage manager"): for each tier in
order, count the leading keys it holds and pin them; round down to whole chunks
and unpin the rest; start a non-blocking get of the hits; continue with the
remaining keys on the next tier (a strict prefix across tiers). The answer is the token
count of the consecutive chunks actually retrieved: a tier that returns fewer
than it promised ends the answer there, and everything after it is released.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from lmkv.base.futures import Finished
from lmkv.memory import MemoryObj, release

logger = logging.getLogger(__name__)


class WeightedSemaphore:
    """Bounds the chunks that concurrent prefetches hold.

    A request of ``n <= budget`` chunks takes ``n``; a larger one waits until
    nothing else holds the semaphore and takes all of it. Concurrent
    allocations therefore never deadlock the allocator.
    """

    def __init__(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.budget = budget
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float | None = None) -> int:
        """Take ``min(n, budget)``; returns what was taken (0 on timeout)."""
        want = min(n, self.budget)
        with self._cond:
            if not self._cond.wait_for(lambda: self._used + want <= self.budget, timeout):
                return 0
            self._used += want
            return want

    def release(self, taken: int) -> None:
        with self._cond:
            self._used -= taken
            if self._used < 0:
                raise RuntimeError("semaphore released more than it gave")
            self._cond.notify_all()

    @property
    def used(self) -> int:
        return self._used


# A finished prefetch that nobody takes or releases (a scheduler that crashed,
# a request that was dropped) is released after this long.
UNCLAIMED_TTL_S = 60.0


@dataclass
class PrefetchTask:
    lookup_id: str
    keys: tuple = ()
    future: Future = field(default_factory=Future)
    objs: list[MemoryObj] = field(default_factory=list)
    cancelled: bool = False
    finished_at: float | None = None
    #: How many leading objs hold exactly their keys' tokens; the ones after may
    #: hold more (block-granular hits: an alias's target), which only a take that
    #: names its keys (and cuts each to its span) may have.
    whole: int | None = None


class EventManager:
    """Tracks prefetches by lookup id: ongoing, done, taken or cleaned up.

    Finished prefetches nobody claims are released after ``unclaimed_ttl_s`` by
    a timer thread (started with the manager, not on a request's path: a
    thread's start waits for it to run, up to milliseconds on busy CPUs), so an
    idle process gives their memory back without waiting for another lookup.
    """

    def __init__(self, unclaimed_ttl_s: float = UNCLAIMED_TTL_S) -> None:
        self._tasks: dict[str, PrefetchTask] = {}
        self._lock = threading.Lock()
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.expired = 0
        self._closed = threading.Event()
        self._reaper = self._start_reaper()

    def _start_reaper(self) -> threading.Thread:
        # (the thread holds the manager weakly: one nobody closed still goes away)
        self._reaper_pid = os.getpid()
        reaper = threading.Thread(target=_reap, args=(weakref.ref(self), self._closed),
                                  daemon=True, name="lmkv-prefetch-expiry")
        reaper.start()
        return reaper

    def start(self, lookup_id: str, keys: Sequence = ()) -> PrefetchTask:
        return self._register(PrefetchTask(lookup_id, tuple(keys)))

    def finished(self, lookup_id: str, keys: Sequence, objs: list[MemoryObj],
                 hit_tokens: int, whole: int | None = None) -> Future:
        """``start`` and ``finish`` at once, for a lookup answered on the caller's
        thread: its future, finished."""
        return self._register(PrefetchTask(
            lookup_id, tuple(keys[:len(objs)]), Finished(hit_tokens), objs,
            finished_at=time.monotonic(), whole=whole)).future

    def _register(self, task: PrefetchTask) -> PrefetchTask:
        with self._lock:
            previous = self._tasks.pop(task.lookup_id, None)
            self._tasks[task.lookup_id] = task
            # (a child forked after the manager was made has no thread of it; the
            # thread ends only then, or when the manager is closed)
            if self._reaper_pid != os.getpid() and not self._closed.is_set():
                self._reaper = self._start_reaper()
        if previous is not None:
            self._discard(previous)  # a reused id's old result
        return task

    def expire(self) -> int:
        """Release the finished prefetches unclaimed for ``unclaimed_ttl_s``; returns how many."""
        with self._lock:
            stale = self._expired_locked()
        for task in stale:
            self._discard(task)
        return len(stale)

    def _expired_locked(self) -> list[PrefetchTask]:
        deadline = time.monotonic() - self.unclaimed_ttl_s
        stale = [t for t in self._tasks.values()
                 if t.finished_at is not None and t.finished_at < deadline]
        for task in stale:
            del self._tasks[task.lookup_id]
        self.expired += len(stale)
        return stale

    def finish(self, task: PrefetchTask, objs: list[MemoryObj], hit_tokens: int) -> None:
        """Called by the storage thread; a task cleaned up meanwhile is released at once."""
        with self._lock:
            cancelled = task.cancelled
            if not cancelled:
                task.objs = objs
            # Only the keys of held chunks are compared at take: drop the rest now
            # (a long miss would otherwise keep every key until it expires).
            task.keys = task.keys[:len(task.objs)]
            task.finished_at = time.monotonic()
        if cancelled:
            release(objs)
        task.future.set_result(hit_tokens)

    def fail(self, task: PrefetchTask, exc: BaseException) -> None:
        logger.warning("lmkv prefetch %s failed: %s", task.lookup_id, exc)
        task.keys = ()
        task.finished_at = time.monotonic()
        if not task.future.done():
            task.future.set_result(0)

    def future(self, lookup_id: str) -> Future | None:
        with self._lock:
            task = self._tasks.get(lookup_id)
        return task.future if task else None

    def held(self, lookup_id: str) -> tuple[list[MemoryObj], tuple] | None:
        """What a finished prefetch holds now and their keys (a partial hit's chunk
        under its leading blocks' key), without taking them (no reference is
        given: look, then ``take``); None while it is running or unknown."""
        with self._lock:
            task = self._tasks.get(lookup_id)
            if task is None or not task.future.done():
                return None
            return list(task.objs), task.keys[:len(task.objs)]

    def take(self, lookup_id: str, keys: Sequence | None = None, longer: bool = False
             ) -> list[MemoryObj] | None:
        """The prefetched chunks (the caller now owns their references), once done.

        With ``keys``, only the chunks of ``keys`` are handed over (chunks
        prefetched beyond them, for a longer prompt, are released), and only if
        the lookup was for the same prefix; otherwise everything is released and
        None is returned (a lookup id reused for another prompt must never yield
        its KV). Without ``keys``, the chunks from the first one that may hold
        more tokens than its key names (``PrefetchTask.whole``) are released,
        unless ``longer`` (the caller cuts them itself: it knows their tokens).
        """
        with self._lock:
            task = self._tasks.get(lookup_id)
            if task is None or not task.future.done():
                return None
            del self._tasks[lookup_id]
            objs, task.objs = task.objs, []
        if keys is None:
            whole = len(objs) if task.whole is None or longer else task.whole
            release(objs[whole:])
            return objs[:whole]
        n = min(len(objs), len(keys))
        if tuple(keys[:n]) != task.keys[:n]:
            release(objs)
            return None
        release(objs[n:])
        return objs[:n]

    def cleanup(self, lookup_id: str) -> None:
        """Release what the lookup prefetched, now or when it finishes."""
        with self._lock:
            task = self._tasks.pop(lookup_id, None)
        if task is not None:
            self._discard(task)

    def _discard(self, task: PrefetchTask) -> None:
        with self._lock:
            task.cancelled = True
            objs, task.objs = task.objs, []
        release(objs)

    def __len__(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        self._closed.set()
        if self._reaper is not threading.current_thread():
            self._reaper.join(5)  # (it wakes at once: it waits on the event set above)
        with self._lock:
            tasks = list(self._tasks.values())
            self._tasks.clear()
        for task in tasks:
            self._discard(task)
            if not task.future.done():  # queued, never run: answer a miss
                task.future.set_result(0)


def _reap(ref: weakref.ref[EventManager], closed: threading.Event) -> None:
    """The expiry thread of the manager ``ref`` names, until it is closed or gone."""
    while True:
        manager = ref()
        if manager is None:
            return
        # A quarter of the TTL: a prefetch is released at most 1.25 TTLs after it
        # finished (and at least each second: a TTL set later is kept within one).
        wait = min(max(manager.unclaimed_ttl_s / 4, 0.01), 1.0)
        del manager
        if closed.wait(wait):
            return
        manager = ref()
        if manager is None:
            return
        try:
            manager.expire()
        except Exception:  # a bug; expiry must go on
            logger.exception("lmkv prefetch expiry failed")
        del manager
