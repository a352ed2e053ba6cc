"""The client's heartbeat: keeps its session and lent buffers alive while it copies,
and tells the server which requests the client gave up on.

A client copies chunk bytes in place (``consume`` of a retrieve, ``fill`` of a
store) between two requests. If that takes longer than the server's session
timeout or handle time to live (a slow copy), the server would end the handle.
A thread of the client's own, on a connection of its own (the caller's holds
the client's lock for the whole transfer), sends ``renew`` for the handles in
use every quarter of the shorter of the two timeouts. A process that stops
altogether (frozen, or a GC pause that holds this thread too) cannot renew:
the server's quarantine then keeps the bytes from being reused under it.

The same thread sends the ids of requests the client abandoned (no reply in
time, or a release that could not be sent) in a ``renew``'s ``abandoned``, at
once and again every interval until the server has them: the server releases
what those requests hold, even when the client has nothing else to say.

On the hot path a transfer costs one dict insert and delete under a lock; the
thread starts with the first transfer and sleeps while there is none.
"""

from __future__ import annotations

import logging
import threading

import zmq

from lmkv.base.logutil import RateLimitedLog
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys
from lmkv.rpc.channel import Channel

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

MIN_INTERVAL_S = 0.05


class Heartbeat:
    def __init__(self, address: str, session: str, context: zmq.Context | None = None,
                 curve: CurveKeys | None = None) -> None:
        self.address = address
        self.session = session
        self._context = context
        self._curve = curve
        self.interval_s = 15.0
        self.renewals = 0
        self._active: dict[int, int] = {}  # handle -> transfers using it
        self._abandoned: dict[int, None] = {}  # request ids not yet told, oldest first
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def set_timeouts(self, session_timeout_s: float, handle_ttl_s: float) -> None:
        self.interval_s = max(MIN_INTERVAL_S, min(session_timeout_s, handle_ttl_s) / 4)

    def begin(self, handle: int) -> None:
        """``handle`` is in use until ``end(handle)``: renew it meanwhile."""
        with self._cond:
            self._active[handle] = self._active.get(handle, 0) + 1
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
            count = self._active.pop(handle, 0) - 1
            if count > 0:
                self._active[handle] = count

    def _run(self) -> None:
        channel = Channel(self.address, self._context, self._curve)
        try:
            while True:
                with self._cond:
                    while not self._active and not self._abandoned and not self._closed:
                        self._cond.wait()
                    if not self._abandoned and not self._closed:
                        self._cond.wait(self.interval_s)
                    if self._closed:
                        return
                    handles, abandoned = list(self._active), list(self._abandoned)
                if (handles or abandoned) and not self._renew(channel, handles, abandoned):
                    with self._cond:  # the server is not there: try again later
                        if not self._closed:
                            self._cond.wait(self.interval_s)
        finally:
            channel.close()

    def _renew(self, channel: Channel, handles: list[int], abandoned: list[int]) -> bool:
        message = p.Renew(handles=handles, session=self.session, abandoned=abandoned)
        result = channel.request(message, timeout_ms=max(1, int(self.interval_s * 1000)))
        if not isinstance(result, tuple) or not isinstance(result[0], p.RenewReply):
            _log.warning("failed", "lmkv client: heartbeat to %s failed (%s)", self.address,
                         result if not isinstance(result, tuple) else type(result[0]).__name__)
            return False
        self.renewals += 1
        if abandoned:
            with self._cond:
                for req_id in abandoned:
                    self._abandoned.pop(req_id, None)
        if result[0].renewed < len(handles):
            _log.warning("lost", "lmkv client: the server no longer holds %d of %d handles "
                         "in use (expired); their buffers stay quarantined until released",
                         len(handles) - result[0].renewed, len(handles))
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
