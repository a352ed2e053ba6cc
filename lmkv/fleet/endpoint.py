"""The peer endpoint: an instance's memory tier, served to its peers.

One ZMQ ROUTER socket and one thread. Only the tier that holds memory is
served (never a disk or remote tier: a peer is asked because it is faster
than those), and only while the tier holds the entry: an entry is pinned
while its frame is made, so eviction cannot take it mid-copy, and is
released before the reply leaves. A peer asks for keys and gets frames bound
to those keys (``lmkv.fleet.wire``); it checks them itself, as every tier
does.

``peer_remove`` drops keys from the tier (a frame a peer found corrupt).
``peer_put`` stores what a peer sends to this instance as the chunk's owner
(rendezvous mode): each frame is decoded under the key it was sent for and
verified before anything is stored, straight into the tier (not through the
storage manager: a peer's put is not written through to this instance's
lower tiers, and never travels further).

Bad input (garbage, a request for more than ``MAX_PEER_KEYS`` keys, a
message of more parts or bytes than that allows, a frame that fails to
verify, a push or remove of a key this instance does not own) gets an error
reply or a shorter answer, one rate-limited log line, and the loop goes on; a
single part over ``max_request_bytes`` makes ZeroMQ drop the connection
(reconnected at once), with no reply. Who may connect is the transport's
business: an ``ipc://`` socket lives in a private directory and is made 0600
(this user only), and a lock file beside it keeps a second process from
taking its address over; a ``tcp://`` one admits only CURVE keys on its
allow list (``PeerOptions`` refuses tcp without CURVE unless told
``insecure``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

from lmkv.base.errors import ConfigError, CorruptFrameError
from lmkv.base.logutil import RateLimitedLog
from lmkv.base.private import ipc_dir_problem
from lmkv.contracts.serde import Serializer
from lmkv.contracts.tier import StorageBackend
from lmkv.fleet import wire
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveAuthenticator, CurveKeys

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

POLL_MS = 100
#: Answers queued per connected peer.
SEND_QUEUE = 2


class PeerEndpoint:
    def __init__(self, tier: StorageBackend, serializer: Serializer, address: str, *,
                 curve: CurveKeys | None = None, max_reply_bytes: int = 256 << 20,
                 max_request_bytes: int = 256 << 20, accept_puts: bool = True,
                 owns: Callable[[CacheKey], bool] = lambda key: True) -> None:
        """``owns``: whether a key is this instance's (the only ones it takes pushes
        and removes of)."""
        self.tier = tier
        self.serializer = serializer
        self.max_reply_bytes = max_reply_bytes
        self.max_request_bytes = max_request_bytes
        self.accept_puts = accept_puts
        self.owns = owns
        self._lock_fd: int | None = None
        self._staging = _Staging()
        # the reply being made's staging buffer, and its frames' trackers
        self._staged: tuple[bytearray, list[zmq.MessageTracker]] | None = None
        # Its own context: ZeroMQ's authentication handler is one per context.
        self.context = zmq.Context()
        self.served = 0  # frames sent
        self.stored = 0  # frames a peer put and this tier took
        self.refused = 0  # requests answered with an error
        self.rejected_frames = 0  # frames of peer_put that failed to verify
        self._auth = CurveAuthenticator(self.context, curve) if curve is not None else None
        self._socket = self.context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_request_bytes)
        # A peer that does not read its answers holds at most this many queued (more
        # are dropped: its requests time out), not a reply buffer per request.
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        if self._auth is not None:
            self._auth.secure(self._socket)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.address = self._bind(address)
        except BaseException:
            self._close_socket()
            raise

    def _bind(self, address: str) -> str:
        problem = ipc_dir_problem(address, create=True)
        if problem:
            raise ConfigError(f"peer endpoint: cannot listen on {address}: its {problem}")
        if address.startswith("ipc://"):
            # Binding an ipc path unlinks whatever socket is there: a second process
            # with the same ``listen`` would silently take the address over.
            self._lock_fd = _lock(address[len("ipc://"):] + ".lock", address)
        if address.startswith("tcp://["):
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            raise ConfigError(f"peer endpoint: cannot listen on {address}: {exc}") from None
        if address.startswith("ipc://"):
            os.chmod(address[len("ipc://"):], 0o600)
        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> PeerEndpoint:
        self._thread = threading.Thread(target=self._serve, name="lmkv-peer-endpoint",
                                        daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            self._loop()
        finally:  # the socket is this thread's: closed here, by no other
            self._close_socket()

    def _loop(self) -> None:
        sock = self._socket
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS, zmq.POLLIN):
                    continue
                parts, whole = self._receive()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            if len(parts) < 2:
                continue  # (no envelope and header: nothing to answer)
            envelope, header, data = parts[0], parts[1], parts[2:]
            if whole:
                reply = self._answer(header.buffer, data)
            else:
                reply = self._error(p.salvage_req_id(header.buffer), p.TOO_LARGE,
                                    f"more than {wire.MAX_PEER_KEYS + 2} parts or "
                                    f"{self.max_request_bytes} bytes in one message")
            staged, self._staged = self._staged, None
            try:
                # Without a copy: the frames are views of a staging buffer, which goes
                # back to the pool with their trackers (done once ZeroMQ let them go).
                sock.send_multipart([envelope, *reply], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:  # the peer went away, or its queue is full
                _log.warning("send", "lmkv peer endpoint: a reply was dropped: %s", exc)
                continue  # (a buffer ZeroMQ may still hold is not reused: the GC frees it)
            finally:
                del reply  # (its frames' own references: their trackers wait for them)
            if staged is not None:
                self._staging.give(*staged)

    def _receive(self) -> tuple[list[zmq.Frame], bool]:
        """One message's parts, part by part: past ``MAX_PEER_KEYS`` frames (plus
        envelope and header) or ``max_request_bytes`` in all, the rest is read and
        dropped, not kept (False: the message was cut)."""
        sock, total, whole = self._socket, 0, True
        parts: list[zmq.Frame] = []
        while True:
            frame = sock.recv(copy=False)
            total += len(frame.buffer)
            if whole and len(parts) < wire.MAX_PEER_KEYS + 3 \
                    and total <= self.max_request_bytes:
                parts.append(frame)
            else:
                whole = False
            if not frame.more:
                return parts, whole

    def _answer(self, header: memoryview, data: list[zmq.Frame]) -> list[Any]:
        req_id = p.salvage_req_id(header)
        try:
            req = wire.decode_peer_request(header)
            req_id = req.req_id
            if isinstance(req, wire.PeerFetch):
                return self._fetch(req)
            if isinstance(req, wire.PeerPut):
                return self._put(req, data)
            if isinstance(req, wire.PeerRemove):
                if not self.accept_puts:
                    raise p.ProtocolError(p.BAD_REQUEST, "this instance takes no removes "
                                          "from peers")
                removed = sum(bool(self.tier.remove(key)) for key in req.cache_keys()
                              if self.owns(key))
                return [p.encode(wire.PeerRemoveReply(req_id=req_id, removed=removed))]
            return [p.encode(wire.PeerPingReply(req_id=req_id, address=self.address))]
        except p.ProtocolError as exc:
            return self._error(req_id, exc.code, exc.reason)
        except Exception as exc:  # a bug here: the peer gets a miss, the loop goes on
            logger.exception("lmkv peer endpoint: a request failed")
            return self._error(req_id, p.INTERNAL, p.one_line(exc))

    def _error(self, req_id: int, code: str, reason: str) -> list[Any]:
        self.refused += 1
        _log.warning(code, "lmkv peer endpoint: refused a request (%s): %s", code, reason)
        return [p.encode(p.ErrorReply(req_id=req_id, code=code, reason=reason))]

    def _fetch(self, req: wire.PeerFetch) -> list[Any]:
        """The frames of the leading keys the tier holds, up to ``max_reply_bytes``
        (at least one); with ``probe``, only their count."""
        tier, keys = self.tier, req.cache_keys()
        if req.probe:
            hits = tier.batched_async_contains("", keys, pin=False)
            return [p.encode(wire.PeerFetchReply(req_id=req.req_id, frames=hits))]
        held: list[tuple[MemoryObj, list[Any], int]] = []  # (chunk, its frame's parts, size)
        total = 0
        try:
            for key in keys:
                if not tier.contains(key, pin=True):
                    break
                try:
                    obj = tier.get_blocking(key)
                finally:
                    tier.unpin(key)
                if obj is None:
                    break
                try:
                    parts = self.serializer.serialize(obj, key)
                except BaseException:
                    obj.ref_down()
                    raise
                size = sum(memoryview(part).nbytes for part in parts)
                if held and total + size > self.max_reply_bytes:
                    obj.ref_down()
                    break
                held.append((obj, parts, size))
                total += size
            # Each frame copied once, into a reused buffer (a fresh one the size of
            # the reply would cost a page fault per 4 KiB, more than the copy).
            staging = self._staging.take(total)
            view = memoryview(staging)
            frames = []
            at = 0
            for _, parts, _size in held:
                start = at
                for part in parts:
                    flat = memoryview(part).cast("B")
                    view[at:at + flat.nbytes] = flat
                    at += flat.nbytes
                frames.append(zmq.Frame(view[start:at], copy=False, track=True))
        finally:
            for obj, _, _ in held:
                obj.ref_down()
        self._staged = (staging, [frame.tracker for frame in frames])
        self.served += len(frames)
        return [p.encode(wire.PeerFetchReply(req_id=req.req_id, frames=len(frames))), *frames]

    def _put(self, req: wire.PeerPut, data: list[zmq.Frame]) -> list[Any]:
        if not self.accept_puts:
            raise p.ProtocolError(p.BAD_REQUEST, "this instance takes no puts from peers")
        keys = req.cache_keys()
        if len(data) != len(keys):
            raise p.ProtocolError(p.BAD_REQUEST, f"{len(keys)} keys but {len(data)} frames")
        tier = self.tier
        accepted = 0
        for key, part in zip(keys, data, strict=True):
            if not self.owns(key):  # a peer's mistake (another fleet list): not stored
                self.rejected_frames += 1
                _log.warning("not-owned", "lmkv peer endpoint: a peer pushed %s, which this "
                             "instance does not own (do the fleet's peers lists differ?)",
                             key.to_string())
                continue
            if tier.contains(key):
                accepted += 1
                continue
            try:
                obj = tier.decode(key, part.buffer, allocate=tier.allocate)
            except CorruptFrameError as exc:
                self.rejected_frames += 1
                _log.warning("corrupt", "lmkv peer endpoint: a peer's frame for %s was "
                             "refused: %s", key.to_string(), exc)
                continue
            if obj is None:  # no room: the rest would find none either
                break
            try:
                stored = tier.batched_submit_put([key], [obj]).result()
            finally:
                obj.ref_down()
            accepted += bool(stored)
        self.stored += accepted
        return [p.encode(wire.PeerPutReply(req_id=req.req_id, accepted=accepted))]

    def close(self) -> None:
        """Stop serving. The thread closes its socket as it ends (a request under way
        finishes first); one still busy after 5 s is left to end on its own."""
        self._stop.set()
        if self._thread is None:
            self._close_socket()
            return
        self._thread.join(5)
        if self._thread.is_alive():
            logger.warning("lmkv peer endpoint: still answering a request after 5 s; "
                           "it closes when that ends")

    def _close_socket(self) -> None:
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.context.term()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class _Staging:
    """The reply buffers the endpoint reuses: a buffer goes back with the tracker of
    the send that uses it and is taken again once ZeroMQ is done with it. At most
    ``keep`` are kept (the largest replies sent); a reader that does not read its
    reply keeps its buffer busy, and the next reply gets another."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._pool: list[tuple[bytearray, list[zmq.MessageTracker]]] = []

    def take(self, nbytes: int) -> bytearray:
        for i, (buf, trackers) in enumerate(self._pool):
            if len(buf) >= nbytes and all(t.done for t in trackers):
                del self._pool[i]
                return buf
        return bytearray(nbytes)

    def give(self, buf: bytearray, trackers: list[zmq.MessageTracker]) -> None:
        self._pool.append((buf, trackers))
        if len(self._pool) > self.keep:  # the smallest goes (ZeroMQ holds it while it needs it)
            self._pool.remove(min(self._pool, key=lambda item: len(item[0])))


def _lock(path: str, address: str) -> int:
    """An exclusive lock on ``path`` (created 0600), held while the descriptor is
    open; ConfigError when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"peer endpoint: cannot listen on {address}: another process "
                          f"serves it (it holds {path})") from None
    return fd
