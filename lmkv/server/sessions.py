"""What the server holds for each client: prefetched lookups and chunk handles.

A session is named by the client (``session`` in every request) and lives
while the client talks: every request renews its lease. Ending a session
(``end_session``, or a lease that ran out because the client was killed)
releases everything it holds, so a vanished engine never leaks server memory.

Handles (lmkv.server.handles) are server-wide numbers for chunk buffers lent
to one session. Each lives for ``handle_ttl_s`` unless renewed (``renew``, the
client's heartbeat while it copies). A handle that runs out, or whose session
does, is released; one on the shared-memory data path is quarantined instead,
because its client may still be copying.

A client that gave up on a request (its timeout) names its ``req_id`` in
``abandoned`` later: what that request holds is released at once (the client
never saw the reply, so it never touches those buffers), or as soon as the
request produces it.

Limits: a session holds at most ``SessionLimits.max_handles`` handles and
``max_bytes`` of arena buffers, its quarantined ones included (lmkv.server.handles:
buffers a silent client may still touch stay its own until it is gone). A
request past them is refused or cut short (lmkv.server.service), so one client,
however it behaves, cannot take the arena from the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import ServerConnection
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj
from lmkv.rpc.protocol import DataPath
from lmkv.server.defaults import DEFAULT_HANDLE_TTL_S, DEFAULT_QUARANTINE_GRACE_S
from lmkv.server.handles import Handle, HandleKind, Quarantine
from lmkv.storage.manager import StorageManager

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

MAX_LOOKUPS_PER_SESSION = 1024
# Abandoned request ids a session remembers for requests still running.
MAX_ABANDONED_PER_SESSION = 1024


#: Without ``server.session_max_bytes``: the share of the memory tier's arena one
#: session may hold.
DEFAULT_ARENA_SHARE = 0.5


@dataclass(frozen=True)
class SessionLimits:
    """What one session may hold at once (config ``server.session_max_*``)."""

    max_handles: int = ServerConnection.model_fields["session_max_handles"].default
    max_bytes: int | None = None  # None: no byte limit

    @classmethod
    def of(cls, server: ServerConnection, arena_bytes: int | None) -> SessionLimits:
        """The config's limits; without ``session_max_bytes``, a share of the arena."""
        configured = server.session_max_bytes
        max_bytes: int | None = None if configured is None else int(configured)
        if max_bytes is None and arena_bytes:
            max_bytes = int(arena_bytes * DEFAULT_ARENA_SHARE)
        return cls(server.session_max_handles, max_bytes)


class Session:
    __slots__ = ("abandoned", "claims", "ended", "handles", "id", "last_seen", "lookups",
                 "peer")

    def __init__(self, session_id: str, now: float) -> None:
        self.id = session_id
        self.last_seen = now
        # The process the server verified for this session (lmkv.server.service):
        # its ipc peer, (pid, identity); and what each process it named turned out.
        self.peer: tuple[int, str] | None = None
        self.claims: dict[str, str] = {}
        # prefetch key -> the request that made it; ordered: oldest first
        self.lookups: dict[str, int] = {}
        self.handles: dict[int, Handle] = {}
        # req_id -> when the client gave it up, for requests not finished then
        self.abandoned: dict[int, float] = {}
        self.ended = False

    def lookup_key(self, lookup_id: str) -> str:
        """The storage manager's id for this session's ``lookup_id`` (ids are per client)."""
        return f"{self.id}\x1f{lookup_id}"


class SessionTable:
    """Sessions by id; used from the server's loop thread only."""

    def __init__(self, storage: StorageManager, timeout_s: float,
                 max_lookups: int = MAX_LOOKUPS_PER_SESSION,
                 handle_ttl_s: float = DEFAULT_HANDLE_TTL_S,
                 quarantine_grace_s: float = DEFAULT_QUARANTINE_GRACE_S,
                 limits: SessionLimits | None = None) -> None:
        self.storage = storage
        self.timeout_s = timeout_s
        self.handle_ttl_s = handle_ttl_s
        self.max_lookups = max_lookups
        self.limits = limits or SessionLimits()
        self.over_limit = 0  # requests refused or cut short by a session's limits
        self.quarantine = Quarantine(quarantine_grace_s)
        self.dropped_lookups = 0
        self.expired = 0
        self.expired_handles = 0
        self.abandoned_handles = 0
        self._sessions: dict[str, Session] = {}
        self._handle_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def touch(self, session_id: str) -> Session:
        """The session (created on first use) with its lease renewed."""
        now = time.monotonic()
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id, now)
            logger.debug("session %s started", session_id)
        session.last_seen = now
        return session

    # -- handles ------------------------------------------------------------------
    def add_handle(self, session: Session, kind: HandleKind, objs: list[MemoryObj],
                   keys: list[CacheKey] | None = None, *, data_path: DataPath,
                   req_id: int = 0, process: str = "") -> Handle | None:
        """A handle on ``objs`` for the session; None (and ``objs`` released) when the
        session ended or the client abandoned ``req_id`` meanwhile."""
        handle = Handle(next(self._handle_ids), kind, objs, keys or [], data_path, req_id,
                        process, time.monotonic() + self.handle_ttl_s)
        if session.ended or (req_id and self.is_abandoned(session, req_id)):
            self.abandoned_handles += not session.ended
            handle.release()
            return None
        session.handles[handle.id] = handle
        return handle

    def room(self, session: Session) -> tuple[int, int | None]:
        """(handles, bytes) the session may still take: its limits less what it holds,
        quarantined buffers included; bytes None: no byte limit."""
        handles, nbytes = self.quarantine.held_by(session.id)
        handles += len(session.handles)
        nbytes += sum(h.nbytes for h in session.handles.values())
        limits = self.limits
        return (limits.max_handles - handles,
                None if limits.max_bytes is None else limits.max_bytes - nbytes)

    def pop_handle(self, session: Session, handle_id: int) -> Handle | None:
        return session.handles.pop(handle_id, None)

    def release_handle(self, session: Session, handle_id: int, req_id: int | None = None) -> int:
        """The client is done with ``handle_id`` (held or quarantined): chunks released.
        With ``req_id``, only a handle lent to that request: an id a client names
        from an earlier run of the server (ids start again) is not another's lease."""
        handle = session.handles.get(handle_id)
        if handle is not None:
            if req_id is not None and handle.req_id != req_id:
                return 0
            del session.handles[handle_id]
            return handle.release()
        return self.quarantine.release(session.id, handle_id, req_id) or 0

    def renew(self, session: Session, handle_ids: list[int]) -> list[int]:
        """Extend the life of the session's ``handle_ids``; those it does not hold."""
        expires = time.monotonic() + self.handle_ttl_s
        missing = []
        for handle_id in handle_ids:
            handle = session.handles.get(handle_id)
            if handle is not None:
                handle.expires = expires
            else:
                missing.append(handle_id)
        return missing

    # -- abandoned requests ---------------------------------------------------------
    def abandon(self, session: Session, req_ids: list[int]) -> int:
        """Release what the requests ``req_ids`` hold, and remember the ids for those
        still running; chunks released."""
        released = 0
        now = time.monotonic()
        for req_id in req_ids:
            for handle in [h for h in session.handles.values() if h.req_id == req_id]:
                del session.handles[handle.id]
                released += handle.release()
                self.abandoned_handles += 1
            released += self.quarantine.release_request(session.id, req_id)
            for key in [k for k, r in session.lookups.items() if r == req_id]:
                del session.lookups[key]
                self.storage.release_prefetched(key)
            session.abandoned[req_id] = now
        while len(session.abandoned) > MAX_ABANDONED_PER_SESSION:
            del session.abandoned[next(iter(session.abandoned))]
        return released

    def is_abandoned(self, session: Session, req_id: int) -> bool:
        return req_id in session.abandoned

    # -- prefetches ------------------------------------------------------------------
    def hold_lookup(self, session: Session, key: str, req_id: int = 0) -> bool:
        """Remember a prefetch of the session; past ``max_lookups`` the oldest is released
        (an engine that never retrieves nor releases must not pin the arena for good).
        False (and the prefetch released) when the client abandoned ``req_id``."""
        session.lookups.pop(key, None)
        if req_id and self.is_abandoned(session, req_id):
            self.storage.release_prefetched(key)
            return False
        session.lookups[key] = req_id
        while len(session.lookups) > self.max_lookups:
            oldest = next(iter(session.lookups))
            del session.lookups[oldest]
            self.storage.release_prefetched(oldest)
            self.dropped_lookups += 1
            _log.warning("too-many", "lmkv server: session %s holds more than %d prefetches; "
                         "released the oldest", session.id, self.max_lookups)
        return True

    def release_lookup(self, session: Session, lookup_id: str) -> bool:
        key = session.lookup_key(lookup_id)
        if key not in session.lookups:
            return False
        del session.lookups[key]
        self.storage.release_prefetched(key)
        return True

    # -- ends -------------------------------------------------------------------------
    def end(self, session_id: str, *, client_done: bool = True) -> tuple[int, int]:
        """Release all a session holds; (lookups, chunks) released. Without
        ``client_done`` (the lease ran out), shared handles go to the quarantine."""
        chunks = self.quarantine.release_session(session_id) if client_done else 0
        session = self._sessions.pop(session_id, None)
        if session is None:
            return 0, chunks
        session.ended = True
        lookups = len(session.lookups)
        for key in session.lookups:
            self.storage.release_prefetched(key)
        session.lookups.clear()
        for handle in session.handles.values():
            if handle.shared and not client_done:
                self.quarantine.hold(handle, session_id, session.last_seen)
            else:
                chunks += handle.release()
        session.handles.clear()
        logger.debug("session %s ended: %d lookups, %d chunks released", session_id, lookups,
                     chunks)
        return lookups, chunks

    def expire(self) -> list[str]:
        """End the sessions whose lease ran out (their client is gone), end the handles
        whose time ran out, and free the quarantined buffers of clients now gone."""
        now = time.monotonic()
        deadline = now - self.timeout_s
        gone = [sid for sid, s in self._sessions.items() if s.last_seen < deadline]
        for sid in gone:
            lookups, chunks = self.end(sid, client_done=False)
            self.expired += 1
            if lookups or chunks:
                logger.info("lmkv server: session %s expired; released %d lookups and %d "
                            "chunks", sid, lookups, chunks)
        for session in self._sessions.values():
            if session.handles:
                self._expire_handles(session, now)
            if session.abandoned:
                old = now - self.handle_ttl_s
                for req_id in [r for r, t in session.abandoned.items() if t < old]:
                    del session.abandoned[req_id]
        self.quarantine.sweep(self._last_seen)
        return gone

    def _expire_handles(self, session: Session, now: float) -> None:
        for handle in [h for h in session.handles.values() if h.expires < now]:
            del session.handles[handle.id]
            self.expired_handles += 1
            if handle.shared:
                self.quarantine.hold(handle, session.id, session.last_seen)
            else:
                _log.warning("handle-ttl", "lmkv server: handle %d of session %s expired "
                             "unused; released %d chunks", handle.id, session.id,
                             handle.release())

    def _last_seen(self, session_id: str) -> float | None:
        session = self._sessions.get(session_id)
        return session.last_seen if session is not None else None

    def close(self) -> None:
        for sid in list(self._sessions):
            self.end(sid)
        self.quarantine.close()  # the server exits: nothing can reuse the arena now

    def counts(self) -> tuple[int, int, int]:
        """(held lookups, staged store chunks, leased retrieve chunks) over all sessions."""
        lookups = staged = leased = 0
        for session in self._sessions.values():
            lookups += len(session.lookups)
            for handle in session.handles.values():
                if handle.kind == "store":
                    staged += len(handle.objs)
                else:
                    leased += len(handle.objs)
        return lookups, staged, leased
