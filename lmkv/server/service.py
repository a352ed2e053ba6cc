"""The server's request handlers: protocol messages in, storage-manager calls out.

Handlers run on the server's loop thread. Each returns an ``Outcome`` (the
reply, raw data parts to send after it, and the chunks to keep referenced
until those parts are sent) or a ``Deferred`` (a prefetch still running: the
loop finishes the request when it resolves, without blocking other clients).
A refused request raises ProtocolError, which the loop turns into an
ErrorReply. Every handler gives back what it allocated or took on every path
that does not end in a handle or a sent reply: a refused or failing request
never holds arena blocks.

Limits: a session's handles and arena bytes, quarantined ones included, are
bounded (lmkv.server.sessions). A store past them gets buffers for the chunks
that fit (its later chunks are dropped, as when the arena is full) or, with
none left, an ``over_limit`` error; a shared-memory retrieve lends the leading
chunks that fit, or answers ``over_limit``. Either way the client sees a
shorter hit or a dropped store, never another client's room.

The client process a shared-memory handle names (for the quarantine) is the one
the server verified, never the ``process`` a request claims: on an ipc socket,
the connection's peer as the kernel reports it (``SO_PEERCRED``, passed in by
the loop); otherwise the claimed process, only if it is alive and maps this
server's arena (checked once per session and claim); else none, and the
quarantine waits for the session's own silence.

Metrics: the handlers record the server's own figures into the process's
recorder (``lmkv.metrics``; exported by ``lmkv server --metrics-port``): each
lookup request (its hit and missed tokens and its latency, when its answer is
known), each retrieve that lends chunks (a load: chunks, tokens, bytes, time
from request to reply) and each committed store. A few additions under a lock
per request; no formatting.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmkv.base.logutil import RateLimitedLog
from lmkv.keys.aliases import chunk_aliases
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryAllocator, MemoryObj, dtype_name, release
from lmkv.memory.shm import SharedSegment, host_id
from lmkv.metrics import recorder
from lmkv.metrics.record import record_load, record_lookup, record_store
from lmkv.rpc import protocol as p
from lmkv.rpc.liveness import claimed_pid, maps_file, pid_identity
from lmkv.server.drops import Drops
from lmkv.server.sessions import Session, SessionTable
from lmkv.storage.manager import Partials, StorageManager, chain_parents

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)
# Processes a session named that the server checked, remembered per session.
MAX_CLAIMS_PER_SESSION = 8

#: The pid of the connection a request came on, when the transport tells it (an
#: ipc peer's ``SO_PEERCRED``); called only for requests that need it.
PeerPid = Callable[[], "int | None"]


def no_peer() -> int | None:
    return None


@dataclass
class Outcome:
    reply: p.Reply
    parts: list[Any] = field(default_factory=list)
    hold: list[MemoryObj] = field(default_factory=list)


@dataclass
class Deferred:
    future: Future
    then: Callable[[], Outcome | Deferred]  # may wait again
    #: With ``otherwise``: the reply is ``then``'s if the future is done within
    #: ``grace_s``, else ``otherwise``'s at that moment (and ``then`` is not called).
    grace_s: float = 0.0
    otherwise: Callable[[], Outcome] | None = None


#: How long a prefetching lookup that does not wait may take to be answered
#: done: a hit in the server's memory (a thread hand-off) is answered with its
#: tokens, not "still loading" and a ``prefetch_status`` round trip after it.
PREFETCH_GRACE_S = 0.005


@dataclass
class ServerCounters:
    requests: int = 0
    error_replies: int = 0
    bad_requests: int = 0
    sending_chunks: int = 0


class KVService:
    def __init__(self, storage: StorageManager, sessions: SessionTable, *, server_id: str,
                 max_request_bytes: int) -> None:
        self.storage = storage
        self.sessions = sessions
        self.server_id = server_id
        self.max_request_bytes = max_request_bytes
        self.counters = ServerCounters()
        memory = next((t for t in storage.tiers if t.holds_memory_objs), None)
        # The cpu tier exposes its arena and, with shared_memory, the segment it lives in.
        self.allocator: MemoryAllocator | None = getattr(memory, "allocator", None)
        self.segment: SharedSegment | None = getattr(memory, "shared_segment", None)
        capacity = memory.capacity_bytes if memory is not None else None
        self.max_chunk_bytes = capacity or max_request_bytes
        self.drops = Drops(storage, self.max_chunk_bytes)
        self._chunk_bytes_known = False
        self._arena_file = self.segment.file_id() if self.segment is not None else None
        self._peer_pid: PeerPid = no_peer
        self._internal_ids = itertools.count(1)
        self._handlers: dict[type, Callable[..., Outcome | Deferred]] = {
            p.Ping: self.ping, p.Lookup: self.lookup, p.PrefetchStatus: self.prefetch_status,
            p.Retrieve: self.retrieve, p.Store: self.store, p.StoreCommit: self.store_commit,
            p.Release: self.release, p.Renew: self.renew, p.EndSession: self.end_session,
            p.Stats: self.stats, p.Drop: self.drop,
        }

    @property
    def shm_name(self) -> str:
        return self.segment.name if self.segment is not None else ""

    def handle(self, req: p.Request, data: Sequence[memoryview],
               peer_pid: PeerPid = no_peer) -> Outcome | Deferred:
        if data and not isinstance(req, p.StoreCommit):
            raise p.ProtocolError(p.BAD_REQUEST, f"{len(data)} unexpected data parts")
        if req.abandoned:
            self.sessions.abandon(self.sessions.touch(req.session), req.abandoned)
        if req.released:
            session = self.sessions.touch(req.session)
            for handle_id, req_id in req.released:
                self.sessions.release_handle(session, handle_id, req_id)
        self._peer_pid = peer_pid  # this request's; handlers run one at a time
        try:
            return self._handlers[type(req)](req, data)
        finally:
            self._peer_pid = no_peer

    # -- handlers ---------------------------------------------------------------
    def ping(self, req: p.Ping, data: Sequence[memoryview]) -> Outcome:
        self.sessions.touch(req.session)
        return Outcome(p.PingReply(
            protocol=p.PROTOCOL_VERSION, pid=os.getpid(), host_id=host_id(),
            shm_name=self.shm_name, shm_size=self.segment.size if self.segment else 0,
            max_request_bytes=self.max_request_bytes,
            session_timeout_s=self.sessions.timeout_s, handle_ttl_s=self.sessions.handle_ttl_s))

    def lookup(self, req: p.Lookup, data: Sequence[memoryview]) -> Outcome | Deferred:
        keys = req.cache_keys()
        kpc = req.keys_per_chunk
        if kpc < 1 or len(keys) != len(req.chunk_ends) * kpc:
            raise p.ProtocolError(p.BAD_REQUEST, f"{len(keys)} keys do not make "
                                  f"{len(req.chunk_ends)} chunks of {kpc} keys")
        partials = _lookup_partials(req, keys, kpc)
        session = self.sessions.touch(req.session)
        start = time.perf_counter()
        if not req.prefetch:
            chunks = self.storage.contains_prefix(keys) // kpc
            hit = req.chunk_ends[chunks - 1] if chunks else 0
            if partials is not None and chunks < len(partials.keys) and partials.keys[chunks]:
                return self._count_partial(session, req, keys[chunks], partials, chunks, hit,
                                           start)
            _lookup_done(req, hit, start)
            return Outcome(p.LookupReply(lookup_id=req.lookup_id, hit_tokens=hit, done=True))
        if not req.lookup_id:
            raise p.ProtocolError(p.BAD_REQUEST, "a lookup with prefetch needs a lookup_id")
        key = session.lookup_key(req.lookup_id)
        # (checked now: a deferred reply runs after this request's peer is gone)
        process = self._client_process(session, "shm", req.process) if req.lend else ""
        future = self.storage.lookup_and_prefetch(key, keys, req.chunk_ends, kpc,
                                                  partials=partials)
        self.sessions.hold_lookup(session, key, req.req_id)
        # Recorded once, when the answer is known (whether the client waits or polls).
        future.add_done_callback(lambda done: _lookup_done(req, _result(done), start))

        def reply() -> Outcome:
            hit = future.result()
            lent = self._lend(session, req, key, process) if req.lend and hit else None
            if lent is None:
                return Outcome(p.LookupReply(lookup_id=req.lookup_id, hit_tokens=hit, done=True))
            handle, lent_keys, objs = lent
            return Outcome(p.LookupReply(lookup_id=req.lookup_id, hit_tokens=hit, done=True,
                                         handle=handle, shm_name=self.shm_name,
                                         chunks=[_info(o, o.offset) for o in objs],
                                         lent_hashes=[k.chunk_hash for k in lent_keys]))

        if future.done():
            return reply()
        if not req.wait:
            return Deferred(future, reply, PREFETCH_GRACE_S, lambda: Outcome(
                p.LookupReply(lookup_id=req.lookup_id, hit_tokens=0, done=False)))
        return Deferred(future, reply)

    def _lend(self, session: Session, req: p.Lookup, key: str, process: str
              ) -> tuple[int, list[CacheKey], list[MemoryObj]] | None:
        """Lend what the finished prefetch ``key`` holds, as a Retrieve of its
        lookup id naming the keys it holds them by would: a lease on the
        shared-memory data path (its handle, those keys, and the chunks). None,
        and the prefetch left held for a Retrieve, unless the client's process
        is verified (``process``), all of it is in the shared segment, and it
        leaves half the session's limits free (one key a chunk)."""
        # Only to a client process verified to map the arena: a lease lent to one
        # that cannot read it (another host) would only hold buffers.
        held = self.storage.events.held(key) if process else None
        if held is None or not held[0] or not self._in_segment(held[0]) \
                or key not in session.lookups or req.keys_per_chunk != 1 or req.meta is None:
            return None
        # Lent leases wait for a load that may come later: they may take only half
        # of the session's limits, the rest stays for its stores and retrieves.
        handles_left, bytes_left = self.sessions.room(session)
        limits = self.sessions.limits
        if handles_left - 1 < limits.max_handles // 2 or (
                bytes_left is not None and limits.max_bytes is not None
                and bytes_left - sum(o.tensor.nbytes for o in held[0]) < limits.max_bytes // 2):
            return None
        # Under the keys the prefetch holds them by: a partial hit's chunk under its
        # leading blocks' key, which a retrieve of the prompt cut there names too.
        keys = list(held[1])
        objs = self.storage.take_prefetched(key, keys)
        session.lookups.pop(key, None)
        if not objs:
            return None
        _record_load(objs, 1, 0, time.perf_counter())
        handle = self.sessions.add_handle(session, "lease", objs, data_path="shm",
                                          req_id=req.req_id, process=process)
        return (handle.id, keys[:len(objs)], objs) if handle is not None else None

    def _count_partial(self, session: Session, req: p.Lookup, key: CacheKey,
                       partials: Partials, index: int, hit: int, start: float
                       ) -> Outcome | Deferred:
        """A counting lookup that missed chunk ``index`` whole: add its longest stored
        leading blocks. Finding them reads the alias and its chunk, which may take a
        lower tier's time: a one-chunk prefetch of the storage manager's does it off
        the loop, and is released at once."""
        ends = req.chunk_ends
        span = ends[index] - (ends[index - 1] if index else 0)
        probe = session.lookup_key(f"\x00count-{next(self._internal_ids)}")
        future = self.storage.lookup_and_prefetch(
            probe, [key], [span], partials=Partials([partials.keys[index]],
                                                    partials.block_tokens))

        def reply() -> Outcome:
            self.storage.release_prefetched(probe)
            _lookup_done(req, hit + future.result(), start)
            return Outcome(p.LookupReply(lookup_id=req.lookup_id,
                                         hit_tokens=hit + future.result(), done=True))

        return reply() if future.done() else Deferred(future, reply)

    def prefetch_status(self, req: p.PrefetchStatus, data: Sequence[memoryview]) -> Outcome:
        session = self.sessions.touch(req.session)
        key = session.lookup_key(req.lookup_id)
        future = self.storage.events.future(key) if key in session.lookups else None
        if future is None:
            state, hit = "unknown", 0
        elif not future.done():
            state, hit = "pending", 0
        else:
            state, hit = "done", future.result()
        return Outcome(p.PrefetchStatusReply(lookup_id=req.lookup_id, state=state,
                                             hit_tokens=hit))

    def retrieve(self, req: p.Retrieve, data: Sequence[memoryview]) -> Outcome | Deferred:
        keys = req.cache_keys() if req.has_keys() else None
        kpc = req.keys_per_chunk
        if kpc < 1 or (keys is not None and len(keys) % kpc):
            raise p.ProtocolError(p.BAD_REQUEST, f"{len(keys or ())} keys are not whole "
                                  f"chunks of {kpc} keys")
        partial_keys = req.partial_keys(keys or [], kpc)
        p.check_block_tokens(req.block_tokens, partial_keys)
        partials = (Partials(partial_keys, req.block_tokens) if partial_keys and any(partial_keys)
                    else None)
        session = self.sessions.touch(req.session)
        process = self._client_process(session, req.data_path, req.process)
        start = time.perf_counter()
        key = session.lookup_key(req.lookup_id) if req.lookup_id else ""
        future = self.storage.events.future(key) if key in session.lookups else None
        if future is None:
            if not keys:
                return self._retrieved(session, req, [], start, process)
            return self._fetch_now(session, req, keys, partials, start, process)

        def finish() -> Outcome | Deferred:
            session.lookups.pop(key, None)
            # With keys: only their chunks, and only if the prefetch was for them. A
            # prefetch for another prompt (a reused id) is released, never lent: these
            # keys are fetched now instead, as if nothing had been prefetched.
            objs = self.storage.take_prefetched(key, keys)
            if objs is None and keys:
                return self._fetch_now(session, req, keys, partials, start, process)
            objs = objs or []
            try:
                return self._retrieved(session, req, objs, start, process)
            except BaseException:
                release(objs)
                raise

        return finish() if future.done() else Deferred(future, finish)

    def _fetch_now(self, session: Session, req: p.Retrieve, keys: list[CacheKey],
                   partials: Partials | None, start: float, process: str
                   ) -> Outcome | Deferred:
        """Retrieve ``keys`` not prefetched: prefetch now, under an id of the server's
        own. Its chunk ends are all 0, so its answer is the tokens of the partial hit
        it ends with (block-granular hits; 0 without one): the reply's
        ``tail_tokens``."""
        kpc = req.keys_per_chunk
        key = session.lookup_key(f"\x00retrieve-{next(self._internal_ids)}")
        future = self.storage.lookup_and_prefetch(key, keys, [0] * (len(keys) // kpc), kpc,
                                                  partials=partials)
        self.sessions.hold_lookup(session, key, req.req_id)

        def finish() -> Outcome:
            session.lookups.pop(key, None)
            # Its own prefetch of ``keys``, all of it: the reply's tail_tokens cuts the
            # partial hit's chunk on the client.
            objs = self.storage.take_prefetched(key, longer=True) or []
            try:
                return self._retrieved(session, req, objs, start, process, future.result())
            except BaseException:
                release(objs)
                raise

        return finish() if future.done() else Deferred(future, finish)

    def _retrieved(self, session: Session, req: p.Retrieve, objs: list[MemoryObj],
                   start: float, process: str, tail_tokens: int = 0) -> Outcome:
        """The reply lending ``objs``; they are released here when nobody may take them
        (the session ended or the client gave the request up meanwhile), and those
        past the session's limits are released once the reply is built (until then
        the caller releases them all if this raises)."""
        if objs and (session.ended or self.sessions.is_abandoned(session, req.req_id)):
            release(objs)
            objs = []
        shared = req.data_path == "shm" and self._in_segment(objs)
        past: list[MemoryObj] = []
        if shared and objs:
            keep = self._chunks_within_limits(session, objs, req.keys_per_chunk)
            objs, past = objs[:keep], objs[keep:]
            if past:
                tail_tokens = 0  # the partial chunk, if any, is not among those kept
        tail = tail_tokens if objs else 0
        if objs:
            _record_load(objs, req.keys_per_chunk, tail, start)
        if shared:
            chunks = [_info(o, o.offset) for o in objs]
            handle = self.sessions.add_handle(session, "lease", objs, data_path="shm",
                                              req_id=req.req_id, process=process
                                              ) if objs else None
            release(past)
            return Outcome(p.RetrieveReply(
                handle=handle.id if handle else 0, data_path="shm", shm_name=self.shm_name,
                chunks=chunks if handle else [], tail_tokens=tail if handle else 0))
        return Outcome(p.RetrieveReply(handle=0, data_path="inline", shm_name="",
                                       chunks=[_info(o, -1) for o in objs], tail_tokens=tail),
                       parts=[o.byte_view().numpy() for o in objs], hold=objs)

    def store(self, req: p.Store, data: Sequence[memoryview]) -> Outcome:
        keys = req.cache_keys()
        if len(req.shapes) != len(keys):
            raise p.ProtocolError(p.BAD_REQUEST, f"{len(req.shapes)} shapes for {len(keys)} keys")
        partial_keys = req.partial_keys(keys) or []
        dtype = p.dtype_of(req.dtype)
        sizes = []
        for i, shape in enumerate(req.shapes):
            try:
                sizes.append(p.check_shape(shape, dtype.itemsize, self.max_chunk_bytes))
            except p.ProtocolError as exc:
                raise p.ProtocolError(exc.code, f"chunk {i}: {exc.reason}") from None
        session = self.sessions.touch(req.session)
        process = self._client_process(session, req.data_path, req.process)
        if sizes and not self._chunk_bytes_known:
            self.storage.set_chunk_bytes(max(sizes))
            self._chunk_bytes_known = True
        # Pin the stored prefix while allocating: these allocations must not evict it.
        pinned = self.storage.pin_prefix(keys)
        first = sum(len(ks) for _, ks in pinned)
        objs: list[MemoryObj] = []
        try:
            handles_left, bytes_left = self.sessions.room(session)
            capped = first < len(keys) and handles_left <= 0
            for shape, size in zip(req.shapes[first:], sizes[first:], strict=True):
                if capped or (bytes_left is not None and size > bytes_left):
                    capped = True
                    break
                obj = self.storage.allocate(shape, dtype)
                if obj is None:
                    break
                objs.append(obj)
                if bytes_left is not None:
                    bytes_left -= size
            if capped:
                self._over_limit(session, "store", none_left=not objs)
            data_path: p.DataPath = ("shm" if req.data_path == "shm"
                                     and self._in_segment(objs) else "inline")
            offset = data_path == "shm"
            chunks = [_info(o, o.offset if offset else -1) for o in objs]
        except BaseException:
            release(objs)
            raise
        finally:
            self.storage.unpin(pinned)
        handle = self.sessions.add_handle(session, "store", objs, keys[first:first + len(objs)],
                                          data_path=data_path, req_id=req.req_id,
                                          process=process if data_path == "shm" else ""
                                          ) if objs else None
        if handle is not None:
            handle.parent = keys[first - 1] if first else None
            handle.aliases = chunk_aliases(handle.keys, partial_keys[first:first + len(objs)])
        if handle is None:
            return Outcome(p.StoreReply(handle=0, first=first, data_path=data_path,
                                        shm_name="", chunks=[]))
        return Outcome(p.StoreReply(
            handle=handle.id, first=first, data_path=data_path,
            shm_name=self.shm_name if offset else "", chunks=chunks))

    def store_commit(self, req: p.StoreCommit, data: Sequence[memoryview]) -> Outcome:
        session = self.sessions.touch(req.session)
        handle = self.sessions.pop_handle(session, req.handle)
        if handle is None or handle.kind != "store":
            if handle is not None:
                session.handles[handle.id] = handle
            elif self.sessions.release_handle(session, req.handle):
                # Quarantined: its time ran out while the client was filling it.
                raise p.ProtocolError(p.UNKNOWN_HANDLE, f"store handle {req.handle} expired "
                                      "before its commit; its chunks are not stored")
            raise p.ProtocolError(p.UNKNOWN_HANDLE, f"no store handle {req.handle} in this "
                                  "session (committed, released, expired, or from an "
                                  "earlier server)")
        start = time.perf_counter()
        try:
            if data or handle.data_path == "inline":
                _copy_parts(handle.objs, data)
            future = self.storage.put(handle.keys, handle.objs,
                                      chain_parents(handle.keys, handle.parent), handle.aliases)
            stored = future.result() if future.done() else len(handle.objs)
            record_store(sum(_tokens(o) for o in handle.objs),
                         sum(o.tensor.nbytes for o in handle.objs), start)
        finally:
            handle.release()
        return Outcome(p.StoreCommitReply(stored=stored))

    def release(self, req: p.Release, data: Sequence[memoryview]) -> Outcome:
        session = self.sessions.touch(req.session)
        released = 0
        if req.handle:
            released += self.sessions.release_handle(session, req.handle)
        if req.lookup_id:
            self.sessions.release_lookup(session, req.lookup_id)
        return Outcome(p.ReleaseReply(released=released))

    def renew(self, req: p.Renew, data: Sequence[memoryview]) -> Outcome:
        session = self.sessions.touch(req.session)
        missing = self.sessions.renew(session, req.handles)
        return Outcome(p.RenewReply(renewed=len(req.handles) - len(missing), missing=missing))

    def end_session(self, req: p.EndSession, data: Sequence[memoryview]) -> Outcome:
        lookups, chunks = self.sessions.end(req.session)
        return Outcome(p.EndSessionReply(lookups=lookups, chunks=chunks))

    def drop(self, req: p.Drop, data: Sequence[memoryview]) -> Outcome | Deferred:
        """Remove the entry under ``req.key`` if it is not what the client expects
        (lmkv.server.drops)."""
        session = self.sessions.touch(req.session)
        outcome = self.drops.start(session, req)

        def reply() -> Outcome:
            return Outcome(p.DropReply(outcome=outcome.result()))

        return reply() if outcome.done() else Deferred(outcome, reply)

    def stats(self, req: p.Stats, data: Sequence[memoryview]) -> Outcome:
        self.sessions.touch(req.session)
        figures = recorder().totals().plain()  # the server process's own recorder
        return Outcome(p.StatsReply(server=self.server_stats(), tiers=self.storage.stats(),
                                    metrics=figures))

    def server_stats(self) -> p.ServerStats:
        lookups, staged, leased = self.sessions.counts()
        alloc = self.allocator
        sessions = self.sessions
        return p.ServerStats(
            sessions=len(sessions), requests=self.counters.requests,
            error_replies=self.counters.error_replies, bad_requests=self.counters.bad_requests,
            expired_sessions=sessions.expired, expired_handles=sessions.expired_handles,
            abandoned_handles=sessions.abandoned_handles,
            quarantined_chunks=sessions.quarantine.chunks,
            held_lookups=lookups, dropped_lookups=self.sessions.dropped_lookups,
            staged_chunks=staged, leased_chunks=leased,
            sending_chunks=self.counters.sending_chunks,
            arena_live_objects=alloc.live_objects if alloc else -1,
            arena_used_bytes=alloc.used_bytes if alloc else -1, shm_name=self.shm_name,
            over_limit=sessions.over_limit, dropped_misfits=self.drops.dropped,
            refused_drops=self.drops.refused)

    # -- limits and the client's process ------------------------------------------
    def _chunks_within_limits(self, session: Session, objs: list[MemoryObj],
                              keys_per_chunk: int) -> int:
        """How many of ``objs`` (whole chunks of ``keys_per_chunk`` buffers) a lease may
        lend within the session's limits; over_limit when not one chunk fits."""
        handles_left, bytes_left = self.sessions.room(session)
        keep = len(objs) if handles_left > 0 else 0
        if keep and bytes_left is not None:
            total = 0
            for i, obj in enumerate(objs):
                total += obj.tensor.nbytes
                if total > bytes_left:
                    keep = i
                    break
        keep -= keep % max(1, keys_per_chunk)
        if keep < len(objs):
            self._over_limit(session, "retrieve", none_left=keep == 0)
        return keep

    def _over_limit(self, session: Session, what: str, *, none_left: bool) -> None:
        """Count a request the session's limits cut short; refuse it when nothing fits."""
        sessions = self.sessions
        sessions.over_limit += 1
        handles_left, bytes_left = sessions.room(session)
        limits = sessions.limits
        held = (f"{limits.max_handles - handles_left} of {limits.max_handles} handles"
                + ("" if bytes_left is None or limits.max_bytes is None else
                   f", {limits.max_bytes - bytes_left} of {limits.max_bytes} bytes"))
        _log.warning(f"over-limit:{what}", "lmkv server: session %s holds %s (quarantined "
                     "buffers included); its %s is %s (server.session_max_handles, "
                     "server.session_max_bytes)", session.id, held, what,
                     "refused" if none_left else "cut short")
        if none_left:
            raise p.ProtocolError(p.OVER_LIMIT, f"this session holds {held} (quarantined "
                                  f"buffers included): at most "
                                  f"server.session_max_handles and session_max_bytes")

    def _client_process(self, session: Session, data_path: p.DataPath, claim: str) -> str:
        """The client process a shared-memory handle of a request names (its
        ``data_path``, and the process it ``claim``s): the one the server
        verified; "" when none could be (see the module docstring)."""
        if data_path != "shm" or self.segment is None:
            return ""
        pid = self._peer_pid()
        if pid is not None:
            if session.peer is None or session.peer[0] != pid:
                session.peer = (pid, pid_identity(pid))
                claimed = claimed_pid(claim) if claim else None
                if claimed is not None and claimed != pid:
                    _log.warning("peer-mismatch", "lmkv server: session %s names process "
                                 "%d, but its ipc socket's peer is pid %d: pid %d is the one "
                                 "checked", session.id, claimed, pid, pid)
            return session.peer[1]
        if not claim:
            return ""
        verified = session.claims.get(claim)
        if verified is None:
            mapped = self._arena_file is not None and maps_file(claim, self._arena_file)
            verified = claim if mapped else ""
            if not mapped:
                _log.warning("unverified", "lmkv server: session %s names a process (%s) "
                             "that does not map this server's arena: not taken; its shared "
                             "buffers are held until the session is silent for "
                             "--quarantine-grace", session.id, claim)
            if len(session.claims) >= MAX_CLAIMS_PER_SESSION:
                session.claims.clear()
            session.claims[claim] = verified
        return verified

    def _in_segment(self, objs: Sequence[MemoryObj]) -> bool:
        alloc = self.allocator
        return self.segment is not None and all(o.allocator is alloc for o in objs)


def _tokens(obj: MemoryObj) -> int:
    """Tokens a chunk buffer holds (a KV chunk: layers, K/V, tokens, heads, head size)."""
    shape = obj.tensor.shape
    return int(shape[2]) if len(shape) == 5 else 0


def _result(future: Future) -> int:
    try:
        return int(future.result())
    except Exception:  # a failed prefetch answers 0 hits
        return 0


def _lookup_done(req: p.Lookup, hit: int, start: float) -> None:
    record_lookup(req.chunk_ends[-1] if req.chunk_ends else 0, hit, start)


def _record_load(objs: Sequence[MemoryObj], keys_per_chunk: int, tail: int,
                 start: float) -> None:
    """A retrieve that lends ``objs`` (``keys_per_chunk`` buffers a chunk, layerwise;
    the last chunk counts ``tail`` tokens when the hit ends inside it)."""
    tokens = sum(_tokens(o) for o in objs) // max(1, keys_per_chunk)
    if tail:
        tokens -= _tokens(objs[-1]) - tail
    record_load(tokens, sum(o.tensor.nbytes for o in objs), start)


def _lookup_partials(req: p.Lookup, keys: list[CacheKey], kpc: int) -> Partials | None:
    """A lookup's ``partial_hashes`` as keys, checked against its chunks: chunk
    ``i``'s leading blocks never add up to more than its tokens (a hit never ends
    past the chunk)."""
    partial_keys = req.partial_keys(keys, kpc)
    p.check_block_tokens(req.block_tokens, partial_keys)
    if not partial_keys or not any(partial_keys):
        return None
    ends = req.chunk_ends
    for i, blocks in enumerate(partial_keys):
        span = ends[i] - (ends[i - 1] if i else 0)
        if len(blocks) * req.block_tokens > span:
            raise p.ProtocolError(p.BAD_REQUEST, f"partial_hashes[{i}]: {len(blocks)} blocks "
                                  f"of {req.block_tokens} tokens, but chunk {i} has {span} "
                                  "tokens: at most its tokens allowed")
    return Partials(partial_keys, req.block_tokens)


def _info(obj: MemoryObj, offset: int) -> p.ChunkInfo:
    tensor = obj.tensor
    return p.ChunkInfo(offset, tensor.numel() * tensor.element_size(), list(tensor.shape),
                       dtype_name(tensor.dtype))


def _copy_parts(objs: Sequence[MemoryObj], data: Sequence[memoryview]) -> None:
    """Copy inline chunk bytes into the staged buffers (one bulk copy per chunk)."""
    if len(data) != len(objs):
        raise p.ProtocolError(p.BAD_REQUEST, f"expected {len(objs)} data parts, got {len(data)}")
    for i, (obj, part) in enumerate(zip(objs, data, strict=True)):
        dest = obj.byte_view().numpy()
        if len(part) != dest.nbytes:
            raise p.ProtocolError(p.BAD_REQUEST, f"data part {i}: {len(part)} bytes, "
                                  f"expected {dest.nbytes}")
        np.copyto(dest, np.frombuffer(part, dtype=np.uint8))
