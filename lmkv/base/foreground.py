"""Background work yields to the requests this process is serving.

lmkv's background threads (faulting in the cpu tier's arena ahead of use,
writing stored chunks through to lower tiers) do work that can wait a little.
Where they share the CPUs with the work a request waits for (a lookup, a load
into the engine's KV, a forward that runs on the CPU), every millisecond they
take is one the request waits: on a host with few CPUs the previous request's
background writes and page faults once made the next request's time to first
token up to three times as long, even at the lowest scheduling priority (the
memory traffic and the kernel's page work are not priorities).

So request paths mark themselves ``busy`` (nested and from any thread: a count),
and background threads call ``wait_idle`` before each unit of their work (one
chunk written, one step of pages faulted in): it returns once nothing is busy,
or after ``MAX_YIELD_S`` at the most (``background_yield_ms`` in the
config, 200 ms by default), so that under unbroken load the background still
moves (a unit at least every ``MAX_YIELD_S`` a thread).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

#: The longest a background unit waits for the foreground to go idle (the
#: config's ``background_yield_ms``, set by ``configure``). It outlasts a warm
#: request's forward; under unbroken load on vLLM's CPU build it still lets
#: each background thread do five units a second.
MAX_YIELD_S = 0.2

_cond = threading.Condition(threading.Lock())
_busy = 0
_yielded_s = 0.0  # (counted: how long background work waited in all)


def enter() -> None:
    """A request path starts (pair with ``leave``)."""
    global _busy
    with _cond:
        _busy += 1


def leave() -> None:
    """A request path ended."""
    global _busy
    with _cond:
        _busy = max(0, _busy - 1)
        if not _busy:
            _cond.notify_all()


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Mark the block as request work: background units wait while it runs."""
    enter()
    try:
        yield
    finally:
        leave()


def configure(max_yield_s: float) -> None:
    """Set ``MAX_YIELD_S`` for this process (0: background work never waits)."""
    global MAX_YIELD_S
    MAX_YIELD_S = max(0.0, max_yield_s)


def is_busy() -> bool:
    return _busy > 0


def wait_idle(timeout: float | None = None) -> bool:
    """Wait (at most ``timeout`` s, default ``MAX_YIELD_S``) until no request path
    is busy; True when none is. Called by background threads before each unit of
    their work."""
    global _yielded_s
    if not _busy:  # (the common case: no lock taken)
        return True
    if timeout is None and MAX_YIELD_S <= 0:
        return False
    start = time.monotonic()
    with _cond:
        idle = _cond.wait_for(lambda: not _busy, MAX_YIELD_S if timeout is None else timeout)
        _yielded_s += time.monotonic() - start
    return idle


def yielded_seconds() -> float:
    """How long background units have waited for the foreground in all."""
    return _yielded_s
