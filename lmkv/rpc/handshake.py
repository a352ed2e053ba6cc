"""Why a ZMQ connection never completed its handshake, in a user's words.

A client whose security does not match the server's (no CURVE against a CURVE
server, a key the server does not admit, the wrong server key) never gets a
connection: with ``IMMEDIATE`` that looks exactly like no server at all. ZMQ
reports the failed handshake on the socket's monitor; ``HandshakeWatch``
keeps the latest outcome, so that the one line a user sees names the
mismatch, not an absent server.

Who reads the events: ZMQ sends each monitor event from the context's I/O
thread with a send that waits while the monitor's queue is full. Left unread
(an idle client whose server is gone retries every half second, a few events
each time), the queue fills within minutes, and the I/O thread then waits
forever: every connection of every socket in that context stops, and nothing
recovers. So no monitor is ever left unread: one thread per process
(``lmkv-zmq-monitors``) reads every watch's monitor as its events arrive,
and the queue to it has no high-water mark, so the I/O thread never waits on
it. Once handed to that thread, a monitor socket is touched by it alone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_DISCONNECTED)
# A connection under way (TCP connecting, or connected and greeting) / ended without
# a handshake outcome (refused, dropped: nothing more to wait for).
_UNDER_WAY = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED
_GONE = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
# Events read from one monitor before the others get their turn.
_MAX_EVENTS = 256
# How long a caller waits for the reader thread to read what a monitor holds now
# (it answers within microseconds unless the process is starved).
SYNC_WAIT_S = 0.5
CLOSE_WAIT_S = 5.0
_ids = itertools.count()

#: The peer spoke another security mechanism (CURVE against plain ZMQ, or back).
MECHANISM_MISMATCH = "mechanism_mismatch"
#: The peer's authenticator refused this side's key.
KEY_REFUSED = "key_refused"
#: The CURVE handshake failed without saying why (for a client: the server's key
#: is not the one it was given).
CURVE_FAILED = "curve_failed"


class _State:
    """What a watch knows, shared by its caller and the reader thread (which holds
    this, never the watch or its socket: a watch dropped unclosed is collected)."""

    __slots__ = ("closed", "cond", "events_read", "failure", "on_failure", "pending")

    def __init__(self, on_failure: Callable[[str], None] | None) -> None:
        self.cond = threading.Condition()
        self.failure: str | None = None
        # A connection under way whose handshake has not ended yet (a busy peer, or
        # a busy machine, may take longer than the request that gave up on it).
        self.pending = False
        self.events_read = 0
        self.on_failure = on_failure
        self.closed = False  # the monitor is closed: nothing more will be read


class HandshakeWatch:
    """The handshake outcomes of one socket; ``failure()`` says the latest failure.

    ``on_failure`` (called on the reader thread, for each failure as it is
    seen): for a server that logs them. ``close()`` before the socket is
    closed and before its context is terminated (a watch dropped unclosed is
    closed when it is collected)."""

    def __init__(self, sock: zmq.Socket,
                 on_failure: Callable[[str], None] | None = None) -> None:
        address = f"inproc://lmkv-handshake-{os.getpid()}-{next(_ids)}"
        sock.monitor(address, _EVENTS)
        monitor = sock.context.socket(zmq.PAIR)
        # No high-water mark: the I/O thread's send to it never waits.
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        self._sock = sock
        self._monitor = monitor  # the reader thread's from now on: never touched here
        self._state = _State(on_failure)
        self._pid = os.getpid()
        self._closed = False
        _reader().submit("add", monitor, self._state, 0.0)
        self._finalizer = weakref.finalize(self, _remove_unclosed, monitor, self._pid)
        self._finalizer.atexit = False

    @property
    def events_read(self) -> int:
        """Monitor events read so far (for tests and diagnostics)."""
        return self._state.events_read

    def failure(self, wait_ms: int = 0) -> str | None:
        """The latest handshake failure, unless a handshake succeeded since (the
        events the monitor holds now are read first). ``wait_ms``: while a
        connection is under way (connecting, or connected and its handshake not
        ended), wait up to that long for how it ends (nothing is waited for once
        it was refused or dropped: no server there)."""
        state = self._state
        if not self._closed and self._pid == os.getpid():
            _reader().submit("sync", self._monitor, state, SYNC_WAIT_S)
        deadline = time.monotonic() + max(0, wait_ms) / 1e3
        with state.cond:
            while state.pending and not state.closed \
                    and (left := deadline - time.monotonic()) > 0:
                state.cond.wait(left)
            return state.failure

    def close(self) -> str | None:
        """Stop watching (the events still queued are read first); the latest
        failure, as ``failure()``."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            if self._pid == os.getpid():  # (a forked child leaves the parent's alone)
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                if not _reader().submit("remove", self._monitor, self._state, CLOSE_WAIT_S):
                    logger.warning("lmkv: the ZMQ monitor reader did not close a monitor "
                                   "in %.0f s; its context may not terminate", CLOSE_WAIT_S)
        with self._state.cond:
            return self._state.failure


def _remove_unclosed(monitor: zmq.Socket, pid: int) -> None:
    """A watch collected unclosed: its monitor is closed (not waited for)."""
    if pid == os.getpid():
        _reader().submit("remove", monitor, None, 0.0)


def _read(monitor: zmq.Socket, state: _State) -> bool:
    """Read what ``monitor`` holds (up to ``_MAX_EVENTS``) into ``state``; True if it
    may hold more. On the reader thread only."""
    seen: list[str] = []
    pending = None
    succeeded = False
    count = 0
    while count < _MAX_EVENTS:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            break
        count += 1
        kind = event["event"]
        if kind & (_UNDER_WAY | _GONE):
            pending = bool(kind & _UNDER_WAY)
            continue
        pending = False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            seen.clear()
            succeeded = True
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            seen.append(KEY_REFUSED)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            seen.append(MECHANISM_MISMATCH)
        else:
            seen.append(CURVE_FAILED)
    if count:
        with state.cond:
            state.events_read += count
            if pending is not None:
                state.pending = pending
            if succeeded:
                state.failure = None
            if seen:
                state.failure = seen[-1]
            state.cond.notify_all()
    if state.on_failure is not None:
        for failure in seen:
            try:
                state.on_failure(failure)
            except Exception:  # a logger's failure must not stop the reader
                logger.exception("lmkv: a handshake failure callback failed")
    return count == _MAX_EVENTS


def _read_all(monitor: zmq.Socket, state: _State) -> None:
    for _ in range(64):  # bounded: a peer retrying as fast as it is read ends too
        if not _read(monitor, state):
            return


class _Reader:
    """The thread that reads every watch's monitor (``submit`` hands it work)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[tuple[str, zmq.Socket, _State | None,
                                   threading.Event | None]] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self._thread: threading.Thread | None = None

    def submit(self, op: str, monitor: zmq.Socket, state: _State | None,
               wait_s: float) -> bool:
        """Ask the thread to ``add``, ``sync`` (read now) or ``remove`` (read what is
        left, then close) ``monitor``; wait up to ``wait_s`` for it to be done."""
        done = threading.Event() if wait_s > 0 else None
        with self._lock:
            self._requests.append((op, monitor, state, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmkv-zmq-monitors",
                                                daemon=True)
                self._thread.start()
        with contextlib.suppress(OSError):  # a full pipe: the thread is awake anyway
            os.write(self.wake_w, b"\0")
        return done.wait(wait_s) if done is not None else True

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.wake_r, zmq.POLLIN)
        states: dict[zmq.Socket, _State] = {}

        def drop(monitor: zmq.Socket) -> None:
            """Stop reading ``monitor`` and close it (its context can then end)."""
            state = states.pop(monitor, None)
            with contextlib.suppress(KeyError, zmq.ZMQError):
                poller.unregister(monitor)
            with contextlib.suppress(zmq.ZMQError):
                monitor.close(linger=0)
            if state is not None:
                with state.cond:
                    state.closed = True
                    state.cond.notify_all()

        more: set[zmq.Socket] = set()  # read up to the cap: their turn again at once
        while True:
            try:
                ready = poller.poll(0 if more else None)
            except zmq.ZMQError:
                # A monitor whose context is being terminated (its watch left open):
                # closed, so that the context ends and the others are read on.
                ready = []
                dead = []
                for monitor in states:
                    try:
                        monitor.getsockopt(zmq.EVENTS)
                    except zmq.ZMQError:
                        dead.append(monitor)
                for monitor in dead:
                    drop(monitor)
                if not dead:  # (not a monitor's context: do not spin on it)
                    logger.warning("lmkv: polling ZMQ monitors failed; retrying")
                    time.sleep(0.01)
            with contextlib.suppress(BlockingIOError):
                while os.read(self.wake_r, 4096):
                    pass
            with self._lock:
                requests, self._requests = self._requests, []
            todo = {m for m in more if m in states}
            todo.update(m for m, _ in ready if m in states)
            for op, monitor, state, done in requests:
                try:
                    if op == "add" and state is not None and monitor not in states:
                        states[monitor] = state
                        poller.register(monitor, zmq.POLLIN)
                        todo.add(monitor)
                    elif op == "sync" and monitor in states:
                        _read_all(monitor, states[monitor])
                        todo.discard(monitor)
                    elif op == "remove":
                        todo.discard(monitor)
                        if monitor in states:
                            _read_all(monitor, states[monitor])
                        elif state is not None:
                            states[monitor] = state  # (so that drop marks it closed)
                        drop(monitor)
                except Exception:  # that monitor only: the others are read on
                    logger.exception("lmkv: reading a ZMQ monitor failed; it is closed")
                    drop(monitor)
                finally:
                    if done is not None:
                        done.set()
            more = set()
            for monitor in todo:
                try:
                    if _read(monitor, states[monitor]):
                        more.add(monitor)
                except Exception:
                    logger.exception("lmkv: reading a ZMQ monitor failed; it is closed")
                    drop(monitor)


_READER: _Reader | None = None
_READER_LOCK = threading.Lock()


def _reader() -> _Reader:
    global _READER
    if _READER is None:
        with _READER_LOCK:
            if _READER is None:
                _READER = _Reader()
    return _READER


def _forget_reader() -> None:
    """In a forked child: the parent's thread is not there (nor usable contexts);
    a reader is made afresh when a watch is."""
    global _READER, _READER_LOCK
    old, _READER, _READER_LOCK = _READER, None, threading.Lock()
    if old is not None:
        for fd in (old.wake_r, old.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_reader)


def client_problem(failure: str | None, has_curve: bool) -> str:
    """What a client tells its user about ``failure`` ("" for none)."""
    if failure == MECHANISM_MISMATCH:
        return ("the server wants CURVE: give this client the CURVE keys of server.curve "
                "(docs/security.md)" if not has_curve else
                "the server does not use CURVE, but this client has server.curve keys")
    if failure == KEY_REFUSED:
        return "the server refused this client's CURVE key (not among its authorized keys)"
    if failure == CURVE_FAILED and has_curve:
        return ("the CURVE handshake failed: is server.curve.server_key this server's "
                "public key?")
    if failure == CURVE_FAILED:
        # A CURVE server that hangs up on a plain greeting before its error reaches
        # the client (which of the two a client sees is a matter of timing).
        return ("the server ended the handshake: it wants CURVE (give this client the "
                "CURVE keys of server.curve, docs/security.md), or it is not an lmkv "
                "server")
    return ""
