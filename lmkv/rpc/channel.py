"""The client's socket: request/reply over a ZMQ DEALER with a deadline per request.

A REQ socket is stuck for good once a reply is lost; a DEALER is not, and
replies are matched to requests by ``req_id`` (a late reply to an abandoned
request is dropped). A request with no reply before its deadline closes the
socket, dropping whatever was still queued for a dead server; the next
request connects a fresh one. The socket is ``IMMEDIATE``: nothing is queued
while no server is connected, so an unreachable server fails a request at
once instead of piling requests up for later. After a failure the channel
is "down": requests fail without waiting until ZMQ, which keeps reconnecting
in the background, has a connection again. A connection whose handshake
failed (CURVE on one side only, a refused key) is told apart from no server
at all: ``handshake_failure`` (lmkv.rpc.handshake).

Request ids come from one counter per process, so two channels that share a
session (an engine's retrieve and lookup connections) never reuse an id: a
request named as abandoned is that request only.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from lmkv.base.logutil import RateLimitedLog
from lmkv.base.private import ipc_dir_problem
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys, secure_client
from lmkv.rpc.handshake import HandshakeWatch

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)
_req_ids = itertools.count(1)  # next() is atomic under the GIL

RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 500


class Failure(enum.Enum):
    UNREACHABLE = "unreachable"  # no connection to a server
    TIMEOUT = "timeout"  # sent, but no reply before the deadline


class Channel:
    def __init__(self, address: str, context: zmq.Context | None = None,
                 curve: CurveKeys | None = None,
                 decode_reply: Callable[[memoryview], Any] = p.decode_reply,
                 max_reply_bytes: int = -1) -> None:
        """``decode_reply``: the protocol's reply decoder (the server's; a peer's,
        ``lmkv.fleet.wire``), raising ``UndecodableReply`` on what is not a reply.
        ``max_reply_bytes``: the largest part of a reply taken (ZeroMQ drops the
        connection on a larger one); -1: no limit (a server this client trusts)."""
        self.address = address
        self._decode_reply = decode_reply
        self._max_reply_bytes = max_reply_bytes
        self.curve = curve
        self.context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._watch: HandshakeWatch | None = None
        self._handshake_failure: str | None = None
        self.down = False

    def handshake_failure(self, wait_ms: int = 0) -> str | None:
        """Why the last connection attempt failed its handshake (lmkv.rpc.handshake's
        codes); None when none did, or a later one succeeded. ``wait_ms``: how long
        to wait for a handshake under way to end (``HandshakeWatch.failure``)."""
        if self._watch is not None:
            self._handshake_failure = self._watch.failure(wait_ms)
        return self._handshake_failure

    def request(self, message: p.Request, parts: Sequence[Any] = (), timeout_ms: int = 500
                ) -> tuple[Any, list[zmq.Frame]] | Failure:
        """Send ``message`` (and raw data ``parts``); the reply and its data parts, or a
        Failure."""
        sock = self._socket if self._socket is not None else self._connect()
        if sock is None:
            self.down = True
            return Failure.UNREACHABLE
        if not sock.poll(0 if self.down else timeout_ms, zmq.POLLOUT):
            self.down = True
            return Failure.UNREACHABLE
        message.req_id = next(_req_ids)
        try:
            sock.send_multipart([p.encode(message), *parts], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.down = True
            return Failure.UNREACHABLE
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0 or not sock.poll(max(1, int(left_ms)), zmq.POLLIN):
                self.reset()
                self.down = True
                return Failure.TIMEOUT
            parts = sock.recv_multipart(copy=False)
            try:
                reply = self._decode_reply(parts[0].buffer)
            except p.UndecodableReply as exc:
                _log.warning("undecodable", "lmkv client: undecodable reply from %s dropped: "
                             "%s", self.address, exc)
                continue
            if reply.req_id != message.req_id:
                continue  # the late reply to an abandoned request
            self.down = False
            return reply, parts[1:]

    def _connect(self) -> zmq.Socket | None:
        # A socket in a directory another user controls may be theirs: whatever
        # answers there could hand us planted KV. Checked on every (re)connect.
        problem = ipc_dir_problem(self.address, create=False)
        if problem:
            _log.warning("foreign", "lmkv client: not connecting to %s: its %s; misses "
                         "until it is private", self.address, problem)
            return None
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            # A server without our key on its list, or not holding the key we expect,
            # never completes the handshake: IMMEDIATE then makes every request a miss.
            secure_client(sock, self.curve)
        self._watch = HandshakeWatch(sock)
        sock.connect(self.address)
        self._socket = sock
        return sock

    def reset(self) -> None:
        """Close the socket (dropping anything queued); the next request opens a new one."""
        if self._watch is not None:
            # kept: the next connection may not get that far
            self._handshake_failure = self._watch.close()
            self._watch = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def close(self) -> None:
        self.reset()
