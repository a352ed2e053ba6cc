"""The client's heartbeat: keeps its session and lent buffers alive while it copies,
and tells the server which requests the client gave up on.

A client copies chunk bytes in place (``consume`` of a retrieve, ``fill`` of a
store) between two requests. If that takes longer than the server's session
timeout or handle time to live (a slow copy), the server would end the handle.
A thread of the client's own, on a connection of its own (the caller's holds
the client's lock for the whole transfer), sends ``renew`` for a handle once
it has been in use for a quarter of the shorter of the two timeouts, and again
every such interval while it stays in use: a transfer shorter than that costs
no request at all. A process that stops altogether (frozen, or a GC pause that
holds this thread too) cannot renew: the server's quarantine then keeps the
bytes from being reused under it.

A renewal may cross the caller's release of the same handle (the caller is
done just as the thread sends it): the server then no longer holds it, and
says so in the reply's ``missing``. Such a handle is not lost: the thread
reports a handle as lost (expired, or a restarted server) only when it is
still in the very use the renewal was sent for, which the caller's release
cannot precede (the caller ends its use before it releases).

The same thread sends the ids of requests the client abandoned (no reply in
time, or a release that could not be sent) in a ``renew``'s ``abandoned``, at
once and again every interval until the server has them: the server releases
what those requests hold, even when the client has nothing else to say.

A lease the caller is done with is not released by a message of its own on the
caller's thread: it waits in the session's ``Releases`` until the next
request of the session carries it (``released``), or this thread sends it
within ``FLUSH_S`` when no request comes first. Holding a lease that long
keeps its chunks from being evicted for that long, nothing more; a release
that may have been lost with its request is named as abandoned instead.

Chunks a lookup's reply lent (lmkv.rpc.client) that no retrieve took within
their age are given back by this thread too, so an engine that goes idle
holds nothing for long.

On the hot path a transfer costs one dict insert and delete under a lock and
no system call: the thread starts with the first transfer, wakes every
``FLUSH_S`` while transfers keep coming (so that nothing needs to wake it),
and sleeps without a deadline once there has been none for ``IDLE_AFTER_S``
(the next transfer then wakes it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import zmq

from lmkv.base.logutil import RateLimitedLog
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys
from lmkv.rpc.channel import Channel

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

MIN_INTERVAL_S = 0.05
#: A given-back lease no request carried is sent by the thread within about this.
FLUSH_S = 0.2
#: With no transfer for this long the thread stops waking by itself.
IDLE_AFTER_S = 10.0


class Releases:
    """Leases a session's clients are done with and have not told the server about:
    handle -> the request that lent it. Shared by the clients of one session (an
    engine's load and lookup connections): whichever sends a request next carries
    them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, int] = {}
        self.since = math.inf  # monotonic: when the oldest was given back

    def add(self, handle: int, req_id: int) -> None:
        with self._lock:
            if not self._items:
                self.since = time.monotonic()
            self._items[handle] = req_id

    def take(self) -> dict[int, int]:
        """All of them, now the caller's to send (at most ``p.MAX_RELEASED``)."""
        if not self._items:  # (read without the lock: a late add waits for the next)
            return {}
        with self._lock:
            items = self._items
            if len(items) <= p.MAX_RELEASED:
                self._items, self.since = {}, math.inf
                return items
            taken = dict(list(items.items())[:p.MAX_RELEASED])
            for handle in taken:
                del items[handle]
            return taken

    def __len__(self) -> int:
        return len(self._items)


class _Use:
    """One stretch of a handle in use, from its first ``begin`` to its last ``end``;
    its identity is what tells a renewal's reply about this stretch from a later one."""

    __slots__ = ("count", "due")

    def __init__(self, due: float) -> None:
        self.count = 1
        self.due = due  # monotonic: when the server should hear about it next


class Heartbeat:
    def __init__(self, address: str, session: str, context: zmq.Context | None = None,
                 curve: CurveKeys | None = None, releases: Releases | None = None,
                 expire: Callable[[float], float] | None = None) -> None:
        self.address = address
        self.session = session
        self.releases = releases if releases is not None else Releases()
        # The client's leases nobody took in time, given back by this thread: called
        # with the time, it gives back those due (into ``releases``) and says when
        # the next are (math.inf: none). It must not wait on the client's lock.
        self._expire = expire
        self._busy_until = 0.0  # monotonic: the thread wakes by itself until then
        self._asleep = False  # waiting without a deadline: a transfer must wake it
        self._context = context
        self._curve = curve
        self.interval_s = 15.0
        self.renewals = 0
        self.lost_handles = 0  # in use, and no longer held by the server
        self._active: dict[int, _Use] = {}  # handle -> its current use
        self._abandoned: dict[int, None] = {}  # request ids not yet told, oldest first
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def set_timeouts(self, session_timeout_s: float, handle_ttl_s: float) -> None:
        with self._cond:
            self.interval_s = max(MIN_INTERVAL_S, min(session_timeout_s, handle_ttl_s) / 4)
            latest = time.monotonic() + self.interval_s
            for use in self._active.values():  # a shorter interval applies at once
                use.due = min(use.due, latest)
            self._cond.notify()

    def begin(self, handle: int) -> None:
        """``handle`` is in use until ``end(handle)``: renew it meanwhile."""
        with self._cond:
            use = self._active.get(handle)
            if use is not None:
                use.count += 1
                return
            now = time.monotonic()
            self._active[handle] = _Use(now + self.interval_s)
            self._busy_until = now + IDLE_AFTER_S
            # A thread that wakes by itself (every FLUSH_S, or interval, at most)
            # finds this one in time: it is due an interval from now.
            self._wake_locked(self._asleep)

    def touch(self) -> None:
        """The client holds something with a due time (``expire``'s): have the
        thread running, and looking at it."""
        with self._cond:
            self._busy_until = time.monotonic() + IDLE_AFTER_S
            self._wake_locked(self._asleep)

    def release_later(self, handle: int, req_id: int) -> None:
        """The caller is done with ``handle`` (lent by request ``req_id``): the session's
        next request tells the server, or this thread does within ``FLUSH_S``."""
        self.releases.add(handle, req_id)
        with self._cond:
            self._busy_until = time.monotonic() + IDLE_AFTER_S
            self._wake_locked(self._asleep)

    def lost_releases(self, released: dict[int, int]) -> None:
        """Releases sent with a request that got no answer (the server may not have
        read them): their requests are named as abandoned, which releases them."""
        for req_id in released.values():
            self.abandon(req_id)

    def abandon(self, req_id: int) -> None:
        """Tell the server (from the thread) that request ``req_id``'s result is unused."""
        with self._cond:
            self._abandoned[req_id] = None
            while len(self._abandoned) > p.MAX_ABANDONED:
                del self._abandoned[next(iter(self._abandoned))]
            self._wake_locked(True)

    def _wake_locked(self, notify: bool) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="lmkv-heartbeat",
                                            daemon=True)
            self._thread.start()
        elif notify:
            self._cond.notify()

    def end(self, handle: int) -> None:
        with self._cond:
            use = self._active.get(handle)
            if use is None:
                return
            use.count -= 1
            if use.count <= 0:
                del self._active[handle]

    def _next_locked(self) -> tuple[dict[int, _Use], list[int], dict[int, int]] | None:
        """Wait until a renewal is due, abandoned ids wait, or given-back leases have
        waited ``FLUSH_S``; the uses, abandoned ids and releases it carries, or None
        once closed."""
        while not self._closed:
            now = time.monotonic()
            expires = self._expire(now) if self._expire is not None else math.inf
            due = {h: u for h, u in self._active.items() if u.due <= now}
            flush = self.releases.since + FLUSH_S <= now
            if due or self._abandoned or flush:
                for use in due.values():
                    use.due = now + self.interval_s
                return due, list(self._abandoned), self.releases.take() if flush else {}
            wake = min((u.due for u in self._active.values() if u.due < math.inf),
                       default=math.inf)
            wake = min(wake, self.releases.since + FLUSH_S, expires)
            if now < self._busy_until:  # (no later than a transfer begun now is due)
                wake = min(wake, now + min(FLUSH_S, self.interval_s))
            self._asleep = wake == math.inf
            self._cond.wait(None if self._asleep else wake - now)
            self._asleep = False
        return None

    def _run(self) -> None:
        channel = Channel(self.address, self._context, self._curve)
        try:
            while True:
                with self._cond:
                    work = self._next_locked()
                if work is None:
                    return
                uses, abandoned, released = work
                if not uses and not abandoned and not released:
                    continue  # (the releases went with a request meanwhile)
                if not self._renew(channel, uses, abandoned, released):
                    with self._cond:  # the server is not there: try again later
                        if not self._closed:
                            self._cond.wait(self.interval_s)
        finally:
            channel.close()

    def _renew(self, channel: Channel, uses: dict[int, _Use], abandoned: list[int],
               released: dict[int, int]) -> bool:
        message = p.Renew(handles=list(uses), session=self.session, abandoned=abandoned,
                          released=list(released.items()))
        result = channel.request(message, timeout_ms=max(1, int(self.interval_s * 1000)))
        if not isinstance(result, tuple) or not isinstance(result[0], p.RenewReply):
            _log.warning("failed", "lmkv client: heartbeat to %s failed (%s)", self.address,
                         result if not isinstance(result, tuple) else type(result[0]).__name__)
            self.lost_releases(released)
            return False
        self.renewals += 1
        with self._cond:
            for req_id in abandoned:
                self._abandoned.pop(req_id, None)
            # Still in the use renewed: the caller has not released it, so the server
            # ended it (its time ran out) or is another server. Any other use ended
            # before its release reached the server: nothing was lost.
            lost = [h for h in set(result[0].missing)
                    if h in uses and self._active.get(h) is uses[h]]
            for handle in lost:  # renewing it again would only ask the same question
                uses[handle].due = math.inf
            self.lost_handles += len(lost)
        if lost:
            _log.warning("lost", "lmkv client: the server no longer holds %d of %d handles "
                         "in use (expired, or the server restarted); their buffers stay "
                         "quarantined until released", len(lost), len(uses))
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
