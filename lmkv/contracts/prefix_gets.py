"""Batched gets of a remote tier: the leading entries, window by window.

A get asks for the chunks of one prompt in order and wants the leading run of
them: the first entry that is absent, corrupt or unreadable ends it. A remote
tier fetches them in windows (one round trip each, sized so a window's frames
fit its buffers), and the next window can travel while this one is checked.
Two helpers carry what every such tier does the same way:

* ``PrefixGets``: the tier's get threads (``batched_get_non_blocking``
  returns at once), and ``read_prefix``, which runs the tier's read under its
  fault policy: a fault answers the prefix decoded so far, a bug gives every
  buffer back and raises, and hits and misses are counted once per get.
* ``read_windows``: the window loop, with the next window fetched ahead on
  another thread if the tier asks, and a window fetched past where the read
  stopped handed back (its buffers released).

A tier author writes what is particular to the storage: how to fetch a
window, and how to check and decode one (``take``)::

    self.gets = PrefixGets(self.faults, threads=4, thread_name="lmkv-hello-get")

    def batched_get_non_blocking(self, lookup_id, keys):
        return self.gets.submit(keys, self._read)

    def get_blocking(self, key):
        objs = self.gets.read_prefix([key], self._read)
        return objs[0] if objs else None

    def _read(self, keys, out):  # runs under the fault policy
        read_windows(keys, lambda: 16, self._fetch,
                     lambda window, frames: self._decode(window, frames, out))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from lmkv.base import affinity
from lmkv.contracts.faults import TierFaults
from lmkv.contracts.tier import done_future
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj

K = TypeVar("K")
W = TypeVar("W")

#: A tier's read: fill ``out`` with the leading entries of ``keys`` found, in
#: order, and return; it may raise the tier's faults (``out`` is kept).
Read = Callable[[Sequence[CacheKey], list[MemoryObj]], None]


class PrefixGets:
    """A remote tier's get threads and its one way of answering a get."""

    def __init__(self, faults: TierFaults, threads: int, thread_name: str) -> None:
        self.faults = faults
        self.counters = faults.counters
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_name,
                                            initializer=affinity.apply)

    def submit(self, keys: Sequence[CacheKey], read: Read) -> Future:
        """``read_prefix(keys, read)`` on a get thread: a future of the leading
        chunks found. No keys, or the tier closed: an answered future of []."""
        if not keys:
            return done_future([])
        try:
            return self._executor.submit(self.read_prefix, list(keys), read)
        except RuntimeError:  # closed
            return done_future([])

    def run(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """``fn(*args)`` on a get thread (a tier's background chore, such as a
        check a lookup asked for); None once closed."""
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # closed
            return None

    def read_prefix(self, keys: Sequence[CacheKey], read: Read) -> list[MemoryObj]:
        """The leading entries of ``keys`` that ``read`` decoded. A fault the tier
        absorbs ends the read with what was decoded so far (counted, rate-logged);
        anything else is a bug: every buffer goes back, then it raises."""
        objs: list[MemoryObj] = []
        try:
            with self.faults.guard("get", "answering misses"):
                read(keys, objs)
        except BaseException:
            for obj in objs:
                obj.ref_down()
            raise
        self.counters.hits += len(objs)
        self.counters.misses += len(objs) < len(keys)
        return objs

    def close(self) -> None:
        """Refuse new gets and drop those queued; gets in progress finish alone."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def read_windows(keys: Sequence[K], size: Callable[[], int], fetch: Callable[[Sequence[K]], W],
                 take: Callable[[Sequence[K], W], bool], *,
                 ahead: Callable[[Sequence[K]], Future | None] | None = None,
                 release: Callable[[W], None] | None = None) -> None:
    """Fetch ``keys`` window by window and hand each to ``take`` until it answers
    False (the prefix ended: an entry absent, corrupt or unreadable) or the keys
    run out.

    ``size()``: keys in the next window, asked before each one (a tier sizes
    them by the frames seen so far). ``fetch(window)``: one round trip, its
    result handed to ``take(window, fetched)``. ``ahead(window)``: a future
    fetching the following window on another thread while ``take`` checks this
    one, or None to fetch it after (``ahead`` None: always after). A window
    fetched ahead and never taken goes to ``release`` (its buffers back), once
    its fetch is over; an exception anywhere leaves the loop the same way.
    """
    window = keys[:max(1, size())]
    if not window:
        return
    fetched = fetch(window)
    start = 0
    pending: Future | None = None
    try:
        while True:
            start += len(window)
            following = keys[start:start + max(1, size())]
            if following and ahead is not None:
                pending = ahead(following)
            if not take(window, fetched) or not following:
                return
            window = following
            # What take checked is let go before the next window is waited for:
            # a tier whose fetch holds its client's buffers gets them back first.
            del fetched
            if pending is not None:
                ready, pending = pending, None
                fetched = ready.result()
            else:
                fetched = fetch(window)
    finally:
        if pending is not None:  # fetched past where the read stopped: given back
            wait([pending])
            if release is not None and pending.exception() is None:
                release(pending.result())
