"""``ServerClient``: what an engine process uses to reach an ``lmkv server``.

Nothing here raises because of the server: an unreachable, slow, restarted
or refusing server is a miss (lookup 0, retrieve nothing, store dropped and
counted in ``counters``), and the client reconnects by itself.

Chunk bytes move through the server's shared-memory arena when the server
runs on this machine and its segment maps (``data_path="auto"``): the client
copies straight into (store) or out of (retrieve) arena buffers with torch.
Otherwise (another machine, a failed mapping, ``data_path="inline"``) they
travel inside the ZMQ messages, sent without copying (the inline data path).

While the caller copies (``consume``, ``fill``) a heartbeat thread keeps the
buffers lent by the server alive (lmkv.rpc.heartbeat); a request that got
no reply in time, or a lease that could not be released, is named to the
server as abandoned, so what it holds there is released.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import torch
import zmq

from lmkv.base.logutil import RateLimitedLog
from lmkv.base.private import default_server_address
from lmkv.config.model import ServerConnection
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import dtype_name, shape_problem
from lmkv.memory.shm import SharedMemoryUnavailable, SharedSegment, host_id
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys
from lmkv.rpc.channel import Channel, Failure
from lmkv.rpc.handshake import client_problem
from lmkv.rpc.heartbeat import Heartbeat, Releases
from lmkv.rpc.liveness import process_identity

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

_CONNECTION = ServerConnection.model_fields  # defaults are the config's, written once
DEFAULT_TIMEOUT_MS = _CONNECTION["timeout_ms"].default
#: How a client's chunks may travel: the values the config's ``data_path`` allows.
DATA_PATHS: tuple[str, ...] = get_args(_CONNECTION["data_path"].annotation)
# Inline transfers get this much time per byte on top of the request timeout.
INLINE_BYTES_PER_MS = 256 << 10
HEADER_ROOM = 1 << 16
R = TypeVar("R", bound=p.Reply)
#: Chunk ``i``'s leading blocks' hashes (block-granular hits); None: whole chunks.
PartialHashes = Sequence[Sequence[bytes]] | None
# Requests whose reply lends something the server holds until it is released.
_HOLDING = (p.Lookup, p.Retrieve, p.Store)


@dataclass
class Lent:
    """Chunks a lookup's reply lent (``start_lookup_hashes(..., lend=True)``): the
    reply (the lease and the lent chunks' hashes), the meta they were looked up
    under, and when the reply came (monotonic)."""

    reply: p.LookupReply
    meta: KeyMeta
    at: float

    def as_retrieve(self) -> p.RetrieveReply:
        """The lease as the Retrieve of its lookup id would have lent it."""
        reply = self.reply
        return p.RetrieveReply(req_id=reply.req_id, server_id=reply.server_id,
                               handle=reply.handle, data_path="shm", shm_name=reply.shm_name,
                               chunks=reply.chunks)


#: Lent chunks a client keeps for the engine's retrieve at most; more and the
#: oldest are given back (an engine retrieves or releases every lookup it makes).
MAX_LENT = 1024


@dataclass
class ClientCounters:
    requests: int = 0
    timeouts: int = 0  # no reply before the deadline
    unreachable: int = 0  # no server connected
    error_replies: int = 0  # the server refused a request
    over_limit: int = 0  # of those, refused as past this session's limits (a miss or drop)
    server_changes: int = 0  # a different server answered (a restart)
    dropped_chunks: int = 0  # chunks a store could not hand to the server


class ServerClient:
    """One engine process's connection (one session) to an lmkv server; thread-safe."""

    def __init__(self, address: str | None = None, *, session: str | None = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 data_path: Literal["auto", "inline"] = _CONNECTION["data_path"].default,
                 context: zmq.Context | None = None, curve: CurveKeys | None = None,
                 releases: Releases | None = None) -> None:
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path {data_path!r}: allowed: {', '.join(DATA_PATHS)}")
        address = address or default_server_address()
        self.address = address if "://" in address else f"tcp://{address}"
        self.session = session or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.timeout_ms = timeout_ms
        self.data_path = data_path
        self.counters = ClientCounters()
        self.info: p.PingReply | None = None
        self.segment: SharedSegment | None = None
        self._channel = Channel(self.address, context, curve)
        #: Leases given back and not told yet (shared with the session's other
        #: clients: ``releases=`` another's): the next request carries them.
        self.releases = releases if releases is not None else Releases()
        #: Lookups whose reply lent their chunks, oldest first (``take_lent``).
        self._lent: dict[str, Lent] = {}
        self._lent_lock = threading.Lock()
        self._heartbeat = Heartbeat(self.address, self.session, context, curve, self.releases,
                                    self._expire_lent)
        self._lock = threading.RLock()
        self._closed = False  # closed for good: no request opens a connection again
        self._chunk_bytes_hint = 32 << 20

    # -- connection -------------------------------------------------------------
    def ping(self, timeout_ms: int | None = None) -> p.PingReply | None:
        """Ask the server who it is (and map its arena); None when it does not answer."""
        with self._lock:
            got = self._call(p.Ping(), p.PingReply, timeout_ms=timeout_ms)
            if got is None:
                return None
            self._adopt(got[0])
            return self.info

    def connection_problem(self, wait_ms: int = 0) -> str:
        """Why the connection to the server fails its handshake, in one clause ("" when
        it does not: no server there, or a working connection). ``wait_ms``: how long
        a handshake under way may take to end (a command that is about to say why it
        got no answer waits; a request path does not)."""
        return client_problem(self._channel.handshake_failure(wait_ms),
                              self._channel.curve is not None)

    @property
    def shared_memory(self) -> bool:
        """Whether chunks move through the server's shared-memory arena now."""
        return self.segment is not None

    def _server(self) -> p.PingReply | None:
        return self.info if self.info is not None else self.ping()

    def _adopt(self, info: p.PingReply) -> None:
        self.info = info
        self._heartbeat.set_timeouts(info.session_timeout_s, info.handle_ttl_s)
        if self.segment is not None and self.segment.name == info.shm_name:
            return
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.data_path == "auto" and info.shm_name and info.host_id == host_id():
            try:
                self.segment = SharedSegment.attach(info.shm_name, info.shm_size)
            except SharedMemoryUnavailable as exc:
                _log.warning("shm", "lmkv client: %s; using the inline data path", exc)

    def _segment_named(self, name: str) -> SharedSegment | None:
        """The mapped segment called ``name``, re-asking the server once if it changed."""
        if self.segment is None or self.segment.name != name:
            self.ping()
        if self.segment is not None and self.segment.name == name:
            return self.segment
        _log.warning("shm-mismatch", "lmkv client: the server named segment %r, which is not "
                     "mapped here", name)
        return None

    def _call(self, message: p.Request, expect: type[R], parts: Sequence[Any] = (),
              timeout_ms: int | None = None) -> tuple[R, list[zmq.Frame]] | None:
        if self._closed:
            return None  # (a late caller, a metrics scrape of a closed engine: a miss)
        message.session = self.session
        released = self.releases.take()
        if released:
            message.released = [*message.released, *released.items()]
        self.counters.requests += 1
        result = self._channel.request(message, parts, timeout_ms or self.timeout_ms)
        if released and (isinstance(result, Failure) or isinstance(result[0], p.ErrorReply)):
            # Maybe never read (no reply, or a request refused before it was handled):
            # name their requests as abandoned (harmless for those the server read).
            self._heartbeat.lost_releases(released)
        if result is Failure.UNREACHABLE:
            self.counters.unreachable += 1
            problem = self.connection_problem()
            if problem:
                _log.warning("handshake", "lmkv client: cannot connect to the lmkv server at "
                             "%s: %s; a miss", self.address, problem)
            else:
                _log.warning("unreachable", "lmkv client: no lmkv server at %s%s; a miss",
                             self.address, " accepts this client's CURVE key" if
                             self._channel.curve is not None else "")
            return None
        if result is Failure.TIMEOUT:
            self.counters.timeouts += 1
            if isinstance(message, _HOLDING):  # a reply may still come, and lend something
                self._heartbeat.abandon(message.req_id)
            _log.warning("timeout", "lmkv client: %s got no reply from %s in time; a miss",
                         type(message).__name__, self.address)
            return None
        reply, data = result
        if self.info is not None and reply.server_id != self.info.server_id:
            self.counters.server_changes += 1
            self.info = None  # a restarted server: re-ask before trusting any offset
        if isinstance(reply, expect):
            return reply, data
        self.counters.error_replies += 1
        if isinstance(reply, p.ErrorReply) and reply.code == p.OVER_LIMIT:
            self.counters.over_limit += 1
        reason = f"{reply.code}: {reply.reason}" if isinstance(reply, p.ErrorReply) \
            else f"unexpected {type(reply).__name__}"
        _log.warning(f"refused:{type(message).__name__}", "lmkv client: server refused %s: %s",
                     type(message).__name__, reason)
        return None

    # -- lookup -------------------------------------------------------------------
    def lookup(self, keys: Sequence[CacheKey], chunk_ends: Sequence[int], *,
               lookup_id: str | None = None, keys_per_chunk: int = 1,
               timeout_ms: int | None = None, partial_hashes: PartialHashes = None,
               block_tokens: int = 0) -> int:
        """Hit prefix in tokens. With ``lookup_id``, the hit chunks are also prefetched
        (held for ``retrieve(lookup_id=...)`` or ``release_lookup``); 0 on any failure.

        ``partial_hashes[i]`` (block-granular hits): chunk ``i``'s leading blocks'
        hashes (``lmkv.keys.chunking.block_prefix_hashes``), blocks of ``block_tokens``: the
        hit then goes on into the first missed chunk by its longest stored leading
        blocks."""
        fields = {**p.key_fields(list(keys)), **p.partial_fields(partial_hashes, block_tokens)}
        return self._lookup(fields, chunk_ends, lookup_id, keys_per_chunk, True, timeout_ms)

    def lookup_hashes(self, meta: KeyMeta, chunk_hashes: Sequence[bytes],
                      chunk_ends: Sequence[int], *, lookup_id: str | None = None,
                      timeout_ms: int | None = None, partial_hashes: PartialHashes = None,
                      block_tokens: int = 0) -> int:
        """``lookup`` for chunk hashes computed elsewhere (one key per hash)."""
        fields = {"meta": meta, "chunk_hashes": list(chunk_hashes),
                  **p.partial_fields(partial_hashes, block_tokens)}
        return self._lookup(fields, chunk_ends, lookup_id, 1, True, timeout_ms)

    def start_lookup(self, keys: Sequence[CacheKey], chunk_ends: Sequence[int],
                     lookup_id: str, *, keys_per_chunk: int = 1,
                     partial_hashes: PartialHashes = None, block_tokens: int = 0) -> bool:
        """Start a prefetch without waiting for it; poll ``prefetch_status``."""
        fields = {**p.key_fields(list(keys)), **p.partial_fields(partial_hashes, block_tokens)}
        return self._lookup(fields, chunk_ends, lookup_id, keys_per_chunk, False,
                            None) is not False

    def start_lookup_hashes(self, meta: KeyMeta, chunk_hashes: Sequence[bytes],
                            chunk_ends: Sequence[int], lookup_id: str, *,
                            partial_hashes: PartialHashes = None, block_tokens: int = 0,
                            lend: bool = False) -> int | None:
        """Start a prefetch of chunk hashes computed elsewhere without waiting for it:
        the hit tokens when the server finished it at once, None while it is still
        loading (poll ``prefetch_status``), 0 when the server does not answer.

        ``lend`` (a process that maps the server's arena, through whichever client
        of its session): the server lends the chunks in its reply when it has
        them at once, as a Retrieve of ``lookup_id`` would; ``take_lent`` then
        hands them to that retrieve, which needs no request of its own."""
        fields = {"meta": meta, "chunk_hashes": list(chunk_hashes),
                  **p.partial_fields(partial_hashes, block_tokens)}
        if lend:
            fields.update(lend=True, process=process_identity())
        got = self._lookup(fields, chunk_ends, lookup_id, 1, False, None)
        return 0 if got is False else got

    def _lookup(self, fields: dict[str, Any], chunk_ends: Sequence[int], lookup_id: str | None,
                kpc: int, wait: bool, timeout_ms: int | None) -> int | bool | None:
        """Waiting: the hit tokens (0 on failure). Not waiting: the hit tokens when
        done, None when pending, False on failure."""
        message = p.Lookup(**fields, chunk_ends=list(chunk_ends), lookup_id=lookup_id or "",
                           prefetch=lookup_id is not None, wait=wait, keys_per_chunk=kpc)
        if lookup_id:
            self.release_lent(lookup_id)  # (an id looked up again: its old lease)
        with self._lock:
            got = self._call(message, p.LookupReply, timeout_ms=timeout_ms)
            if got is None:
                return 0 if wait else False
            reply = got[0]
            if reply.handle and lookup_id:
                lent = Lent(reply, fields["meta"], time.monotonic())
                if self._server() is None:  # (its timeouts say how long lent chunks last)
                    self._release_lent(lent)
                else:
                    self._keep_lent(lookup_id, lent)
        return reply.hit_tokens if reply.done else None

    # -- chunks lent by a lookup ------------------------------------------------------
    # ``_lent_lock`` guards the dict alone: leases are given back outside it (the
    # heartbeat thread takes it, holding its own lock, to expire them).
    def _keep_lent(self, lookup_id: str, lent: Lent) -> None:
        """Keep what a lookup's reply lent (the heartbeat gives back those nobody
        took in time); give back one it replaces, and the oldest past ``MAX_LENT``."""
        with self._lent_lock:
            replaced = self._lent.pop(lookup_id, None)  # (the newest goes last)
            self._lent[lookup_id] = lent
            extra = [self._lent.pop(next(iter(self._lent)))
                     for _ in range(len(self._lent) - MAX_LENT)]
        if replaced is not None:
            extra.append(replaced)
        for old in extra:
            self._release_lent(old)
        self._heartbeat.touch()

    def _lent_max_age_s(self) -> float:
        """How long lent chunks are read without asking: half the shorter of the
        server's handle time to live and session timeout, so that the lease (which
        the server started before it replied) has not run out when they are read."""
        info = self.info
        if info is None:
            return 0.0
        return min(info.handle_ttl_s, info.session_timeout_s) / 2

    def _expire_lent(self, now: float) -> float:
        """Give back (through the heartbeat, which calls this) lent chunks no retrieve
        took within their age; when the next ones are due (``math.inf``: none)."""
        max_age = self._lent_max_age_s()
        stale = []
        with self._lent_lock:
            while self._lent:
                first = next(iter(self._lent.values()))
                if first.at + max_age > now:
                    break
                stale.append(self._lent.pop(next(iter(self._lent))))
            due = next(iter(self._lent.values())).at + max_age if self._lent else math.inf
        for lent in stale:  # (a server that lends reads ``released``)
            self.releases.add(lent.reply.handle, lent.reply.req_id)
        return due

    def take_lent(self, lookup_id: str) -> Lent | None:
        """What the lookup ``lookup_id``'s reply lent, for the retrieve that loads it
        (``retrieve_into(..., lent=)``), which then gives it back; None when
        nothing was, or it is too old to be read without asking (then it is given
        back, and a Retrieve asks)."""
        if not self._lent:  # (read without the lock: nothing lent is the common miss)
            return None
        with self._lent_lock:
            lent = self._lent.pop(lookup_id, None)
        if lent is not None and time.monotonic() - lent.at > self._lent_max_age_s():
            self._release_lent(lent)
            return None
        return lent

    def release_lent(self, lookup_id: str) -> bool:
        """Give back what the lookup ``lookup_id``'s reply lent; False when nothing."""
        if not self._lent:  # (read without the lock: the common case, every lookup)
            return False
        with self._lent_lock:
            lent = self._lent.pop(lookup_id, None)
        self._release_lent(lent)
        return lent is not None

    def release_all_lent(self) -> None:
        with self._lent_lock:
            lent_list, self._lent = self._lent, {}
        for lent in lent_list.values():
            self._release_lent(lent)

    def _release_lent(self, lent: Lent | None) -> None:
        if lent is not None:
            self._release(lent.as_retrieve())

    def prefetch_status(self, lookup_id: str) -> int | None:
        """Hit tokens once the prefetch is done, None while pending, -1 for an unknown id;
        0 when the server does not answer (the engine recomputes)."""
        with self._lock:
            got = self._call(p.PrefetchStatus(lookup_id=lookup_id), p.PrefetchStatusReply)
        if got is None:
            return 0
        reply = got[0]
        return {"done": reply.hit_tokens, "pending": None, "unknown": -1}[reply.state]

    def release_lookup(self, lookup_id: str) -> None:
        with self._lock:
            self._call(p.Release(lookup_id=lookup_id), p.ReleaseReply)

    # -- retrieve -------------------------------------------------------------------
    def retrieve(self, keys: Sequence[CacheKey] | None = None, *, lookup_id: str = "",
                 out: Sequence[torch.Tensor] | None = None, keys_per_chunk: int = 1,
                 timeout_ms: int | None = None) -> list[torch.Tensor]:
        """The stored prefix of ``keys`` (or what ``lookup_id`` prefetched), one tensor per
        chunk, copied into ``out`` when given; [] on any failure."""
        result: list[torch.Tensor] = []

        def copy(views: list[torch.Tensor]) -> None:
            for i, view in enumerate(views):
                dest = out[i] if out is not None and i < len(out) else None
                if dest is not None and (dest.dtype != view.dtype or dest.shape != view.shape):
                    _log.warning("shape", "lmkv client: chunk %d is %s %s, not what was "
                                 "asked; keeping the %d before it", i, view.dtype,
                                 list(view.shape), i)
                    break
                result.append(view.clone() if dest is None else dest.copy_(view))

        expected = (sum(t.numel() * t.element_size() for t in out) if out is not None
                    else None)
        self.retrieve_into(keys, copy, lookup_id=lookup_id, keys_per_chunk=keys_per_chunk,
                           timeout_ms=timeout_ms, expected_bytes=expected)
        return result

    def retrieve_into(self, keys: Sequence[CacheKey] | None,
                      consume: Callable[..., Any], *, lookup_id: str = "",
                      keys_per_chunk: int = 1, timeout_ms: int | None = None,
                      expected_bytes: int | None = None, partial_hashes: PartialHashes = None,
                      block_tokens: int = 0, lent: Lent | None = None) -> int:
        """Call ``consume`` with the stored prefix of ``keys`` (or what ``lookup_id``
        prefetched): one read-only tensor per chunk, valid only during the call (views
        of the server's arena, or of the reply's data parts: no copy is made). Returns the
        number of chunks handed over; 0, without calling ``consume``, on any failure.

        With ``partial_hashes`` (as in ``lookup``) the prefix may end inside a chunk,
        by that chunk's longest stored leading blocks; ``consume`` is then called as
        ``consume(views, tail_tokens)``: ``tail_tokens`` > 0 says the last view is such
        a partial hit, and only its first ``tail_tokens`` tokens are the prompt's (the
        view may hold more: the stored chunk they lead).

        ``lent``: what ``lookup_id``'s lookup lent (``take_lent``): its chunks, those
        of ``keys``' leading ones, are handed over without asking the server,
        then given back; when they are not ``keys``' they are given back and the
        server is asked."""
        fields = p.key_fields(list(keys)) if keys is not None else {}
        partial = p.partial_fields(partial_hashes, block_tokens)
        with self._lock:
            if lent is not None:
                reply = lent.as_retrieve()
                n = _lent_for(lent, keys, keys_per_chunk)
                if n:
                    return self._hand_over(reply, [], n, partial, consume)
                self._release(reply)
            if self._server() is None:
                return 0
            inline = self.segment is None
            if expected_bytes is None:
                expected_bytes = len(keys or ()) * self._chunk_bytes_hint
            message = p.Retrieve(**fields, **partial, lookup_id=lookup_id,
                                 keys_per_chunk=keys_per_chunk,
                                 data_path="inline" if inline else "shm",
                                 process="" if inline else process_identity())
            got = self._call(message, p.RetrieveReply,
                             timeout_ms=self._timeout(timeout_ms, expected_bytes if inline else 0))
            if got is None:
                return 0
            reply, data = got
            return self._hand_over(reply, data, len(reply.chunks), partial, consume)

    def _hand_over(self, reply: p.RetrieveReply, data: list[zmq.Frame], n: int,
                   partial: dict[str, Any], consume: Callable[..., Any]) -> int:
        """Call ``consume`` with the first ``n`` of the reply's chunks, then give its
        lease back; the number of chunks handed over."""
        if reply.handle:
            self._heartbeat.begin(reply.handle)
        try:
            views = self._views(reply, data)[:n]
            if views and partial:
                tail = reply.tail_tokens if len(views) == len(reply.chunks) else 0
                consume(views, max(tail, 0))
            elif views:
                consume(views)
            return len(views)
        finally:
            if reply.handle:
                self._heartbeat.end(reply.handle)
                self._release(reply)

    def _release(self, reply: p.RetrieveReply | p.StoreReply) -> None:
        """Give a handle back without a message of its own: the session's next
        request carries it, or the heartbeat sends it shortly (lmkv.rpc.heartbeat),
        so the thread that loads pays nothing for it. A release lost with its
        request names that request as abandoned; one lost with the client ends
        with the handle's lease. A server older than ``released`` is told by the
        heartbeat at once, naming the request as abandoned (which releases it)."""
        info = self.info
        if info is not None and info.protocol >= p.RELEASED_SINCE:
            self._heartbeat.release_later(reply.handle, reply.req_id)
        else:
            self._heartbeat.abandon(reply.req_id)

    def _views(self, reply: p.RetrieveReply, data: list[zmq.Frame]) -> list[torch.Tensor]:
        """Typed views of the reply's chunks (the valid prefix of them)."""
        segment = self._segment_named(reply.shm_name) if reply.data_path == "shm" else None
        if reply.data_path == "shm" and segment is None:
            return []
        if reply.data_path == "inline" and len(data) != len(reply.chunks):
            _log.warning("parts", "lmkv client: %d data parts for %d chunks", len(data),
                         len(reply.chunks))
            return []
        views: list[torch.Tensor] = []
        for i, info in enumerate(reply.chunks):
            dtype = p.DTYPES.get(info.dtype)
            if dtype is None or info.nbytes <= 0 \
                    or shape_problem(info.shape, dtype.itemsize, info.nbytes) is not None \
                    or info.nbytes != math.prod(info.shape) * dtype.itemsize:
                _log.warning("chunk", "lmkv client: chunk %d (%s %s, %d bytes) is malformed; "
                             "keeping the %d before it", i, info.dtype, info.shape,
                             info.nbytes, i)
                break
            if segment is not None:
                if info.offset < 0 or info.offset + info.nbytes > segment.size:
                    break
                raw = segment.tensor[info.offset:info.offset + info.nbytes]
            else:
                if len(data[i].buffer) != info.nbytes:
                    break
                raw = _part_tensor(data[i])
            views.append(raw.view(dtype).view(info.shape))
            self._chunk_bytes_hint = max(self._chunk_bytes_hint, info.nbytes)
        return views

    # -- store ----------------------------------------------------------------------
    def store(self, keys: Sequence[CacheKey], chunks: Sequence[torch.Tensor], *,
              timeout_ms: int | None = None) -> int:
        """Store ``chunks[i]`` under ``keys[i]``; returns the chunks newly stored.

        Chunks the server holds already are skipped; chunks that cannot be handed
        over (no server, no room, a refusal) are counted in ``dropped_chunks``.
        """
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        if not keys:
            return 0
        dtype = chunks[0].dtype
        if any(c.dtype != dtype for c in chunks):
            raise ValueError("all chunks of one store must have one dtype")

        def fill(first: int, buffers: list[torch.Tensor]) -> None:
            for buf, chunk in zip(buffers, chunks[first:], strict=False):
                buf.copy_(chunk)

        return self.store_from(keys, [tuple(c.shape) for c in chunks], dtype, fill,
                               timeout_ms=timeout_ms)

    def store_from(self, keys: Sequence[CacheKey], shapes: Sequence[Sequence[int]],
                   dtype: torch.dtype, fill: Callable[[int, list[torch.Tensor]], Any], *,
                   timeout_ms: int | None = None, partial_hashes: PartialHashes = None
                   ) -> int:
        """``store`` without a staging copy: the server lends buffers for the chunks it
        lacks and ``fill(first, buffers)`` writes chunk ``first + i`` into
        ``buffers[i]`` (arena views when shared memory works, else tensors sent as the
        request's data parts). Returns the chunks newly stored.

        ``partial_hashes[i]`` (block-granular hits): chunk ``i``'s leading blocks'
        hashes; the server stores each, with the chunks it stores, as an alias of
        its chunk (``lmkv.keys.aliases``), so a prompt that leaves this one inside the
        chunk still hits those blocks."""
        if len(keys) != len(shapes):
            raise ValueError(f"{len(keys)} keys for {len(shapes)} shapes")
        if not keys:
            return 0
        with self._lock:
            info = self._server()
            if info is None:
                self.counters.dropped_chunks += len(keys)
                return 0
            nbytes = [math.prod(s) * dtype.itemsize for s in shapes]
            stored = 0
            for start, end in self._batches(nbytes, info):
                count, complete = self._store_batch(
                    list(keys[start:end]), shapes[start:end], dtype,
                    lambda first, bufs, start=start: fill(start + first, bufs), timeout_ms,
                    partial_hashes[start:end] if partial_hashes else None)
                stored += count
                if not complete:  # later chunks extend a prefix the server lacks
                    self.counters.dropped_chunks += len(keys) - end
                    break
            return stored

    def _batches(self, nbytes: Sequence[int], info: p.PingReply) -> list[tuple[int, int]]:
        if self.segment is not None:
            return [(0, len(nbytes))]
        limit = info.max_request_bytes - HEADER_ROOM
        batches, start, size = [], 0, 0
        for i, n in enumerate(nbytes):
            if i > start and size + n > limit:
                batches.append((start, i))
                start, size = i, 0
            size += n
        batches.append((start, len(nbytes)))
        return batches

    def _store_batch(self, keys: list[CacheKey], shapes: Sequence[Sequence[int]],
                     dtype: torch.dtype, fill: Callable[[int, list[torch.Tensor]], Any],
                     timeout_ms: int | None, partial_hashes: PartialHashes = None
                     ) -> tuple[int, bool]:
        """(chunks stored, whether every chunk of the batch is now on the server)."""
        inline = self.segment is None
        message = p.Store(**p.key_fields(keys), **p.partial_fields(partial_hashes),
                          shapes=[list(s) for s in shapes],
                          dtype=dtype_name(dtype), data_path="inline" if inline else "shm",
                          process="" if inline else process_identity())
        got = self._call(message, p.StoreReply, timeout_ms=timeout_ms)
        if got is None:
            self.counters.dropped_chunks += len(keys)
            return 0, False
        reply = got[0]
        first, count = reply.first, len(reply.chunks)
        no_room = len(keys) - first - count
        self.counters.dropped_chunks += no_room
        if not count:
            return 0, no_room == 0
        todo = shapes[first:first + count]
        if any(info.nbytes != math.prod(s) * dtype.itemsize
               for info, s in zip(reply.chunks, todo, strict=True)):
            self._release(reply)
            self.counters.dropped_chunks += count
            return 0, False
        segment = self._segment_named(reply.shm_name) if reply.data_path == "shm" else None
        if reply.data_path == "shm" and (segment is None or any(
                i.offset < 0 or i.offset + i.nbytes > segment.size for i in reply.chunks)):
            self._release(reply)
            self.counters.dropped_chunks += count
            return 0, False
        parts: list[Any] = []
        self._heartbeat.begin(reply.handle)
        try:
            if reply.data_path == "shm":
                buffers = [segment.tensor[i.offset:i.offset + i.nbytes].view(dtype).view(s)
                           for i, s in zip(reply.chunks, todo, strict=True)]
            else:
                buffers = [torch.empty(tuple(s), dtype=dtype) for s in todo]
            fill(first, buffers)
            if reply.data_path != "shm":
                parts = [_byte_array(b) for b in buffers]
        except BaseException:  # the caller's tensors failed to copy: free the buffers
            self._release(reply)
            raise
        finally:
            self._heartbeat.end(reply.handle)
        nbytes = sum(part.nbytes for part in parts)
        committed = self._call(p.StoreCommit(handle=reply.handle), p.StoreCommitReply, parts,
                               timeout_ms=self._timeout(timeout_ms, nbytes))
        if committed is None:
            # Refused (the buffers are still staged) or lost: give them back either way.
            self.counters.dropped_chunks += count
            self._release(reply)
            return 0, False
        return committed[0].stored, no_room == 0

    def _timeout(self, timeout_ms: int | None, inline_bytes: int) -> int:
        return (timeout_ms or self.timeout_ms) + inline_bytes // INLINE_BYTES_PER_MS

    # -- drop -----------------------------------------------------------------------
    def drop(self, key: CacheKey, shape: Sequence[int], dtype: torch.dtype, *,
             chunk_tokens: int = 0, timeout_ms: int | None = None) -> p.DropOutcome | None:
        """Ask the server to remove the entry under ``key``, read and found not to be
        the KV the key names: a chunk of ``dtype`` and ``shape`` (of up to
        ``chunk_tokens`` tokens, cut to ``shape``'s: a block-granular hit's chunk). The
        server checks the entry itself: ``"dropped"``, ``"kept"`` (it is what was
        expected) or ``"absent"``; None when the server did not answer (logged)."""
        message = p.Drop(key=key, dtype=dtype_name(dtype), shape=list(shape),
                         chunk_tokens=chunk_tokens)
        with self._lock:
            got = self._call(message, p.DropReply, timeout_ms=timeout_ms)
        return got[0].outcome if got else None

    # -- the rest ---------------------------------------------------------------------
    def stats(self) -> p.StatsReply | None:
        with self._lock:
            got = self._call(p.Stats(), p.StatsReply)
        return got[0] if got else None

    def end_session(self) -> p.EndSessionReply | None:
        """Release everything the server holds for this client (prefetches, buffers)."""
        with self._lock:
            got = self._call(p.EndSession(), p.EndSessionReply)
        return got[0] if got else None

    def close_connection(self) -> None:
        """Drop the connection, leaving the session to another client that shares it."""
        with self._lock:
            self._heartbeat.close()
            self._heartbeat = Heartbeat(self.address, self.session, self._channel.context,
                                        self._channel.curve, self.releases, self._expire_lent)
            self._channel.close()
            if self.segment is not None:
                self.segment.close()
                self.segment = None
            self.info = None

    def close(self, end_session: bool = True) -> None:
        """End the session (when the server is there; not with ``end_session=False``,
        for a client that shares it with another) and drop the connection, for
        good: a request after this is a miss that connects nowhere (a socket left
        reconnecting to a server that is gone would outlive its owner)."""
        with self._lock:
            if self._closed:
                return
            if end_session and self.info is not None and not self._channel.down:
                self.end_session()
            self.close_connection()
            self._closed = True

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lent_for(lent: Lent, keys: Sequence[CacheKey] | None, keys_per_chunk: int) -> int:
    """How many of ``lent``'s chunks a retrieve of ``keys`` may take: those of its
    leading keys, when the chunks were lent under those very keys (the lookup's
    meta, and the hashes the reply names); 0 when they were not (an id reused
    for another prompt never yields its KV), as the server's take of a prefetch."""
    reply = lent.reply
    if keys is None or keys_per_chunk != 1 or len(reply.lent_hashes) != len(reply.chunks):
        return 0
    n = min(len(reply.chunks), len(keys))
    for key, chunk_hash in zip(keys[:n], reply.lent_hashes[:n], strict=True):
        if key.meta != lent.meta or key.chunk_hash != chunk_hash or key.layer >= 0:
            return 0
    return n


def _byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a numpy array sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _part_tensor(part: zmq.Frame) -> torch.Tensor:
    """A received message part's bytes as a uint8 tensor sharing its memory (read it only)."""
    with warnings.catch_warnings():  # torch warns that the buffer is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(part.buffer, dtype=torch.uint8)
