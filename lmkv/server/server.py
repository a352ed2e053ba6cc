"""The server's loop: one ZMQ ROUTER socket, many clients, one thread.

Requests are decoded and handled on the loop thread; a request that waits for
a prefetch is finished when the prefetch resolves (the storage thread queues
the completion and wakes the loop through a pipe), so one slow lookup never
holds up the other clients. Whatever a request does wrong (garbage, a
truncated message, an oversized message, a failing handler) gets an ErrorReply
with a reason, and the loop goes on; its log lines are rate-limited, so a
flood of bad requests cannot flood the log either.

Inline chunk data is sent without copying (``copy=False``): the data parts are
views of arena buffers, which stay referenced until ZMQ reports them sent.

On an ipc socket ZMQ reads the peer's credentials (``SO_PEERCRED``) when a
client connects and appends them to each message's ``Peer-Address`` property
(``host:uid:gid:pid``): the service asks for the pid when it needs to know
which process a shared-memory handle lends to.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import itertools
import logging
import math
import os
import secrets
import time
import traceback
from collections.abc import Callable
from functools import partial

import zmq

from lmkv.base.errors import LMKVError
from lmkv.base.logutil import RateLimitedLog
from lmkv.base.private import ipc_dir_problem
from lmkv.memory import MemoryObj, release
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveAuthenticator, CurveKeys
from lmkv.rpc.handshake import CURVE_FAILED, MECHANISM_MISMATCH, HandshakeWatch
from lmkv.server.service import Deferred, KVService, Outcome, no_peer
from lmkv.server.sessions import (
    DEFAULT_HANDLE_TTL_S,
    DEFAULT_QUARANTINE_GRACE_S,
    SessionLimits,
    SessionTable,
)
from lmkv.storage.manager import StorageManager

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

RECV_BATCH = 64
EXPIRY_CHECK_S = 1.0
# A message past this many times --max-request-bytes is cut off by ZMQ itself (the
# peer is disconnected, no reply): it bounds what a runaway client makes us buffer.
HARD_LIMIT_FACTOR = 4


class ServerError(LMKVError):
    """The server cannot start (address in use, bad address)."""


class KVServer:
    def __init__(self, storage: StorageManager, *, endpoint: str, max_request_bytes: int,
                 session_timeout_s: float, curve: CurveKeys | None = None,
                 handle_ttl_s: float = DEFAULT_HANDLE_TTL_S,
                 quarantine_grace_s: float = DEFAULT_QUARANTINE_GRACE_S,
                 limits: SessionLimits | None = None) -> None:
        self.storage = storage
        self.endpoint = endpoint
        self.max_request_bytes = max_request_bytes
        self.server_id = secrets.token_hex(8)
        self.sessions = SessionTable(storage, session_timeout_s, handle_ttl_s=handle_ttl_s,
                                     quarantine_grace_s=quarantine_grace_s, limits=limits)
        self.service = KVService(storage, self.sessions, server_id=self.server_id,
                                 max_request_bytes=max_request_bytes)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_request_bytes * HARD_LIMIT_FACTOR)
        if ":" in endpoint.removeprefix("tcp://").rpartition(":")[0]:
            self._router.setsockopt(zmq.IPV6, 1)
        # With CURVE, only clients holding an authorized key get past the handshake.
        self._auth = CurveAuthenticator(self._ctx, curve) if curve is not None else None
        self._watch: HandshakeWatch | None = None
        if self._auth is not None:
            self._auth.secure(self._router)
            # A client without CURVE fails the handshake before any request: only
            # the socket's monitor sees it, and the log says so.
            self._watch = HandshakeWatch(self._router, on_failure=self._log_handshake)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Deferred replies ready to go out, and the grace deadlines of those with an
        # ``otherwise`` (one flag per such reply: answered already).
        self._completions: collections.deque[
            tuple[list[bytes], int, Callable[[], Outcome | Deferred], list[bool] | None]
        ] = collections.deque()
        self._deadlines: list[tuple[float, int, list[bytes], int, Callable[[], Outcome],
                                    list[bool]]] = []
        self._deadline_ids = itertools.count()
        self._sending: list[tuple[list[zmq.MessageTracker], list[MemoryObj]]] = []
        self._stopping = False
        self._closed = False
        self._ipc = endpoint.startswith("ipc://")

    def bind(self) -> str:
        """Listen on the endpoint; returns the bound address (the real port for port 0).

        An ``ipc://`` socket goes into a private directory (created 0700; an existing
        one must be this user's and writable by nobody else) and is made 0600."""
        problem = ipc_dir_problem(self.endpoint, create=True)
        if problem:
            raise ServerError(f"cannot listen on {self.endpoint}: its {problem}")
        try:
            self._router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise ServerError(f"cannot listen on {self.endpoint}: {_bind_problem(exc)}"
                              ) from None
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        return self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Make ``serve`` return; safe from a signal handler or another thread."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        if self._closed:
            return
        # A full pipe means the loop is awake anyway.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    # -- the loop ---------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_expiry = time.monotonic() + EXPIRY_CHECK_S
        while not self._stopping:
            timeout_ms = 5 if self._sending else int(EXPIRY_CHECK_S * 1000)
            if self._deadlines:
                soonest = self._deadlines[0][0] - time.monotonic()
                timeout_ms = max(0, min(timeout_ms, math.ceil(soonest * 1000)))
            events = dict(poller.poll(timeout_ms))
            if self._wake_r in events:
                self._drain_wake_pipe()
            if self._sending:
                self._reap_sent()
            self._run_completions()
            if self._deadlines:
                self._run_deadlines()
            if self._router in events:
                self._receive()
            now = time.monotonic()
            if now >= next_expiry:
                self.sessions.expire()
                next_expiry = now + EXPIRY_CHECK_S

    def _log_handshake(self, failure: str) -> None:
        """A client's failed handshake (on the thread that reads ZMQ monitors)."""
        if failure == MECHANISM_MISMATCH:
            _log.warning("no-curve", "lmkv server: a client without CURVE tried to "
                         "connect to %s; this server admits only CURVE clients with an "
                         "authorized key (docs/security.md)", self.endpoint)
        elif failure == CURVE_FAILED:
            _log.warning("bad-curve", "lmkv server: a client's CURVE handshake on %s "
                         "failed (does it hold this server's public key?)", self.endpoint)

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _receive(self) -> None:
        for _ in range(RECV_BATCH):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(parts)

    def _on_message(self, parts: list[zmq.Frame]) -> None:
        self.service.counters.requests += 1
        envelope = [parts[0].bytes]
        body = parts[1:]
        if body and len(body[0]) == 0:  # a REQ client's empty delimiter: echo it back
            envelope.append(b"")
            body = body[1:]
        req_id = 0
        try:
            if not body:
                raise p.ProtocolError(p.BAD_REQUEST, "empty message: no header part")
            header = body[0].buffer
            size = sum(len(f) for f in body)
            if size > self.max_request_bytes:
                req_id = p.salvage_req_id(header)
                raise p.ProtocolError(p.TOO_LARGE, f"request of {size} bytes exceeds the "
                                      f"server's --max-request-bytes {self.max_request_bytes}")
            try:
                req = p.decode_request(header)
            except p.ProtocolError:
                req_id = p.salvage_req_id(header)
                raise
            req_id = req.req_id
            peer = partial(_peer_pid, parts[0]) if self._ipc else no_peer
            result = self.service.handle(req, [f.buffer for f in body[1:]], peer)
        except p.ProtocolError as exc:
            self._send_error(envelope, req_id, exc.code, exc.reason)
            return
        except Exception as exc:  # a bug in a handler must not stop the server
            self._internal_error(envelope, req_id, exc)
            return
        self._reply_or_defer(envelope, req_id, result)

    def _reply_or_defer(self, envelope: list[bytes], req_id: int,
                        result: Outcome | Deferred) -> None:
        if isinstance(result, Deferred):
            then = result.then
            answered: list[bool] | None = None
            if result.otherwise is not None:
                answered = [False]
                heapq.heappush(self._deadlines, (
                    time.monotonic() + result.grace_s, next(self._deadline_ids), envelope,
                    req_id, result.otherwise, answered))
            result.future.add_done_callback(
                lambda _f: self._complete_later(envelope, req_id, then, answered))
        else:
            self._send(envelope, req_id, result)

    def _complete_later(self, envelope: list[bytes], req_id: int,
                        then: Callable[[], Outcome | Deferred],
                        answered: list[bool] | None = None) -> None:
        """Called on a storage thread: queue the completion for the loop thread."""
        if self._closed:
            return  # the session was ended at close; nothing waits for the reply
        self._completions.append((envelope, req_id, then, answered))
        self._wake()

    def _run_deadlines(self) -> None:
        """Answer the deferred replies whose grace ran out with their ``otherwise``."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, envelope, req_id, otherwise, answered = heapq.heappop(self._deadlines)
            if answered[0]:
                continue
            answered[0] = True
            try:
                self._send(envelope, req_id, otherwise())
            except Exception as exc:
                self._internal_error(envelope, req_id, exc)

    def _run_completions(self) -> None:
        while self._completions:
            envelope, req_id, then, answered = self._completions.popleft()
            if answered is not None:
                if answered[0]:
                    continue  # its grace ran out: "otherwise" was the reply
                answered[0] = True
            try:
                outcome = then()
            except p.ProtocolError as exc:
                self._send_error(envelope, req_id, exc.code, exc.reason)
                continue
            except Exception as exc:
                self._internal_error(envelope, req_id, exc)
                continue
            self._reply_or_defer(envelope, req_id, outcome)  # it may wait again

    # -- replies ----------------------------------------------------------------
    def _send(self, envelope: list[bytes], req_id: int, outcome: Outcome) -> None:
        reply = outcome.reply
        reply.req_id = req_id
        reply.server_id = self.server_id
        head = [*envelope, p.encode(reply)]
        if not outcome.parts:
            self._router.send_multipart(head)
            return
        trackers = []
        try:
            self._router.send_multipart(head, zmq.SNDMORE)
            last = len(outcome.parts) - 1
            for i, part in enumerate(outcome.parts):
                trackers.append(self._router.send(part, zmq.SNDMORE if i < last else 0,
                                                  copy=False, track=True))
        except zmq.ZMQError as exc:
            _log.warning("send", "lmkv server: a reply could not be sent: %s", exc)
        self._sending.append((trackers, outcome.hold))
        self.service.counters.sending_chunks += len(outcome.hold)

    def _internal_error(self, envelope: list[bytes], req_id: int, exc: Exception) -> None:
        # The traceback is formatted only when the rate limit lets the line out.
        _log.log(logging.ERROR, "internal", "lmkv server: request failed: %s", _Traceback(exc))
        self._send_error(envelope, req_id, p.INTERNAL, p.one_line(exc), logged=True)

    def _send_error(self, envelope: list[bytes], req_id: int, code: str, reason: str, *,
                    logged: bool = False) -> None:
        counters = self.service.counters
        counters.error_replies += 1
        counters.bad_requests += code == p.BAD_REQUEST
        if not logged:
            _log.warning(f"error:{code}", "lmkv server: refused a request (%s): %s", code,
                         reason)
        reply = p.ErrorReply(code=code, reason=reason, req_id=req_id, server_id=self.server_id)
        self._router.send_multipart([*envelope, p.encode(reply)])

    def _reap_sent(self) -> None:
        still = []
        for trackers, hold in self._sending:
            if all(t.done for t in trackers):
                release(hold)
                self.service.counters.sending_chunks -= len(hold)
            else:
                still.append((trackers, hold))
        self._sending = still

    # -- shutdown ---------------------------------------------------------------
    def close(self, drain_timeout_s: float) -> bool:
        """Stop serving, release what clients held, and wait for queued lower-tier
        stores (up to ``drain_timeout_s``); True when they all reached their tiers."""
        if self._closed:
            return True
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()  # its sockets would keep the context from terminating
        self._ctx.term()  # ZMQ is done with every message part it was sending
        for _, hold in self._sending:
            release(hold)
        self._sending.clear()
        self._completions.clear()
        self.sessions.close()
        pending = sum(t.get("write_queue_chunks", 0) for t in self.storage.stats())
        t0 = time.monotonic()
        flushed = self.storage.flush(drain_timeout_s)
        if flushed:
            logger.info("lmkv server: flushed %d queued lower-tier chunks in %.2f s", pending,
                        time.monotonic() - t0)
        elif drain_timeout_s == 0:
            logger.info("lmkv server: --drain-timeout 0: not waiting for %d queued "
                        "lower-tier chunks; they are dropped", pending)
        else:
            logger.warning("lmkv server: lower-tier stores still queued after %.1f s; "
                           "the rest is dropped", drain_timeout_s)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        return flushed


def _peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process at the other end of an ipc connection, as the kernel
    reported it when it connected; None where ZMQ does not say (no SO_PEERCRED) or
    the peer's pid is not visible in this pid namespace (0)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
    fields = address.rsplit(":", 3) if isinstance(address, str) else []
    if len(fields) != 4 or not all(f.isdigit() for f in fields[1:]):
        return None
    return int(fields[3]) or None


def _bind_problem(exc: zmq.ZMQError) -> str:
    # ZMQ reads a TCP host it cannot parse as an address as a network interface's
    # name, so a name nothing resolves reports ENODEV, "No such device".
    if exc.errno == errno.ENODEV:
        return ("the host cannot be resolved: give an IP address, a network interface "
                "or a host name this machine resolves")
    return zmq.strerror(exc.errno)


class _Traceback:
    """An exception's traceback, formatted only if a log line prints it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __str__(self) -> str:
        return "".join(traceback.format_exception(self.exc)).rstrip()
