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

On the hot path a transfer costs one dict insert and delete under a lock; the
thread starts with the first transfer and sleeps while there is none.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq

from lmkv.base.logutil import RateLimitedLog
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys
from lmkv.rpc.channel import Channel

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

MIN_INTERVAL_S = 0.05


class _Use:
    """One stretch of a handle in use, from its first ``begin`` to its last ``end``;
    its identity is what tells a renewal's reply about this stretch from a later one."""

    __slots__ = ("count", "due")

    def __init__(self, due: float) -> None:
        self.count = 1
        self.due = due  # monotonic: when the server should hear about it next


class Heartbeat:
    def __init__(self, address: str, session: str, context: zmq.Context | None = None,
                 curve: CurveKeys | None = None) -> None:
        self.address = address
        self.session = session
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
            self._active[handle] = _Use(time.monotonic() + self.interval_s)
            # The thread sleeps without a deadline only while nothing is in use; with
            # something in use, it wakes at a due time no later than this one's.
            self._wake_locked(len(self._active) == 1)

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

    def _next_locked(self) -> tuple[dict[int, _Use], list[int]] | None:
        """Wait until a renewal is due; the uses and abandoned ids it carries, or None
        once closed."""
        while not self._closed:
            now = time.monotonic()
            due = {h: u for h, u in self._active.items() if u.due <= now}
            if due or self._abandoned:
                for use in due.values():
                    use.due = now + self.interval_s
                return due, list(self._abandoned)
            wake = min((u.due for u in self._active.values() if u.due < math.inf),
                       default=None)
            self._cond.wait(None if wake is None else wake - now)
        return None

    def _run(self) -> None:
        channel = Channel(self.address, self._context, self._curve)
        try:
            while True:
                with self._cond:
                    work = self._next_locked()
                if work is None:
                    return
                uses, abandoned = work
                if not self._renew(channel, uses, abandoned):
                    with self._cond:  # the server is not there: try again later
                        if not self._closed:
                            self._cond.wait(self.interval_s)
        finally:
            channel.close()

    def _renew(self, channel: Channel, uses: dict[int, _Use], abandoned: list[int]) -> bool:
        message = p.Renew(handles=list(uses), session=self.session, abandoned=abandoned)
        result = channel.request(message, timeout_ms=max(1, int(self.interval_s * 1000)))
        if not isinstance(result, tuple) or not isinstance(result[0], p.RenewReply):
            _log.warning("failed", "lmkv client: heartbeat to %s failed (%s)", self.address,
                         result if not isinstance(result, tuple) else type(result[0]).__name__)
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
