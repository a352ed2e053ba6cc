"""What the server holds for each client: prefetched lookups and chunk handles.

A session is named by the client (``session`` in every request) and lives
while the client talks: every request renews its lease. Ending a session
(``end_session``, or a lease that ran out because the client was killed)
releases everything it holds, so a vanished engine never leaks server memory.

Handles are server-wide numbers for chunk buffers lent to one session:
``store`` handles hold freshly allocated buffers until the commit; ``lease``
handles hold retrieved chunks until the client has copied them out.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from lmkv.logutil import RateLimitedLog
from lmkv.memory import MemoryObj
from lmkv.prefetch import release
from lmkv.storage import StorageManager
from lmkv.tokens import CacheKey

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

MAX_LOOKUPS_PER_SESSION = 1024
HandleKind = Literal["store", "lease"]


@dataclass
class Handle:
    id: int
    kind: HandleKind
    objs: list[MemoryObj]
    keys: list[CacheKey] = field(default_factory=list)
    transport: str = "shm"

    def release(self) -> int:
        objs, self.objs = self.objs, []
        release(objs)
        return len(objs)


@dataclass
class Session:
    id: str
    last_seen: float
    lookups: dict[str, None] = field(default_factory=dict)  # ordered: oldest first
    handles: dict[int, Handle] = field(default_factory=dict)
    ended: bool = False

    def lookup_key(self, lookup_id: str) -> str:
        """The storage manager's id for this session's ``lookup_id`` (ids are per client)."""
        return f"{self.id}\x1f{lookup_id}"


class SessionTable:
    """Sessions by id; used from the server's loop thread only."""

    def __init__(self, storage: StorageManager, timeout_s: float,
                 max_lookups: int = MAX_LOOKUPS_PER_SESSION) -> None:
        self.storage = storage
        self.timeout_s = timeout_s
        self.max_lookups = max_lookups
        self.dropped_lookups = 0
        self._sessions: dict[str, Session] = {}
        self._handle_ids = itertools.count(1)
        self.expired = 0

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

    def add_handle(self, session: Session, kind: HandleKind, objs: list[MemoryObj],
                   keys: list[CacheKey] | None = None, transport: str = "shm") -> Handle:
        handle = Handle(next(self._handle_ids), kind, objs, keys or [], transport)
        session.handles[handle.id] = handle
        return handle

    def pop_handle(self, session: Session, handle_id: int) -> Handle | None:
        return session.handles.pop(handle_id, None)

    def hold_lookup(self, session: Session, key: str) -> None:
        """Remember a prefetch of the session; past ``max_lookups`` the oldest is released
        (an engine that never retrieves nor releases must not pin the arena for good)."""
        session.lookups.pop(key, None)
        session.lookups[key] = None
        while len(session.lookups) > self.max_lookups:
            oldest = next(iter(session.lookups))
            del session.lookups[oldest]
            self.storage.release_prefetched(oldest)
            self.dropped_lookups += 1
            _log.warning("too-many", "lmkv server: session %s holds more than %d prefetches; "
                         "released the oldest", session.id, self.max_lookups)

    def release_lookup(self, session: Session, lookup_id: str) -> bool:
        key = session.lookup_key(lookup_id)
        if key not in session.lookups:
            return False
        del session.lookups[key]
        self.storage.release_prefetched(key)
        return True

    def end(self, session_id: str) -> tuple[int, int]:
        """Release all a session holds; (lookups, chunks) released."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return 0, 0
        session.ended = True
        lookups = len(session.lookups)
        for key in session.lookups:
            self.storage.release_prefetched(key)
        session.lookups.clear()
        chunks = sum(h.release() for h in session.handles.values())
        session.handles.clear()
        logger.debug("session %s ended: %d lookups, %d chunks released", session_id, lookups,
                     chunks)
        return lookups, chunks

    def expire(self) -> list[str]:
        """End the sessions whose lease ran out (their client is gone)."""
        deadline = time.monotonic() - self.timeout_s
        gone = [sid for sid, s in self._sessions.items() if s.last_seen < deadline]
        for sid in gone:
            lookups, chunks = self.end(sid)
            self.expired += 1
            if lookups or chunks:
                logger.info("lmkv server: session %s expired; released %d lookups and %d "
                            "chunks", sid, lookups, chunks)
        return gone

    def close(self) -> None:
        for sid in list(self._sessions):
            self.end(sid)

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
