"""Chunk buffers lent to a client, and the quarantine of those a client may still touch.

A handle holds arena buffers for one client: ``store`` handles hold freshly
allocated buffers until the commit; ``lease`` handles hold retrieved chunks
until the client has copied them out. Every handle has a time to live that
the client's heartbeat renews while it copies.

A handle on the shared-memory data path lends bytes the client reads or
writes in place. When it ends without the client saying it is done (its time
to live or its session ran out: a frozen process, a GC pause longer than the
timeouts), the client may still be inside its copy: freeing the buffers would
let the arena hand the same bytes to another chunk, and the late copy would
read another chunk's KV or overwrite it. So the buffers are quarantined
instead (kept referenced, so the arena cannot reuse them) until the client
is known gone:

- it says it is done: it releases the handle, commits it, names its
  request as abandoned, or ends its session;
- its process has exited (``lmkv.rpc.liveness``: same host and pid
  namespace, and the pid is gone, a zombie, or reused). The process is the
  one the server verified (lmkv.server.service): the ipc socket's peer, or
  a named process that maps the arena; never a name taken on trust;
- when its process cannot be checked (another pid namespace, no process
  verified): its session has been silent for the quarantine grace period.

A live process that never speaks again keeps what it held in quarantine until
it exits: counted in ``quarantined_chunks``, and against its session's limits
(lmkv.server.sessions), so it is never more than one session may hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from lmkv.base.logutil import RateLimitedLog
from lmkv.keys.aliases import Alias
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj, release
from lmkv.rpc.liveness import process_state
from lmkv.rpc.protocol import DataPath

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

HandleKind = Literal["store", "lease"]


@dataclass
class Handle:
    id: int
    kind: HandleKind
    objs: list[MemoryObj]
    keys: list[CacheKey]
    data_path: DataPath  # how its chunks travel: in the shared segment, or inline
    req_id: int = 0  # the request that made it (for ``abandoned``)
    process: str = ""  # the client process that maps the arena (liveness)
    expires: float = 0.0  # monotonic; renewed by the client's heartbeat
    parent: CacheKey | None = None  # a store's: the key its first chunk extends
    aliases: list[Alias] = field(default_factory=list)  # a store's: its chunks' leading blocks
    nbytes: int = 0  # arena bytes its buffers hold (what its session's byte limit counts)

    def __post_init__(self) -> None:
        self.nbytes = sum(o.tensor.nbytes for o in self.objs)

    @property
    def shared(self) -> bool:
        """Whether the client reads or writes these buffers in place."""
        return self.data_path == "shm" and bool(self.objs)

    def release(self) -> int:
        objs, self.objs = self.objs, []
        release(objs)
        return len(objs)


@dataclass
class _Held:
    handle: Handle
    session_id: str
    last_heard: float


class Quarantine:
    """Buffers of shared handles that ended while their client may still copy."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._held: dict[int, _Held] = {}
        self._by_session: dict[str, list[int]] = {}  # session -> [handles, bytes]
        self.chunks = 0

    def __len__(self) -> int:
        return len(self._held)

    def held_by(self, session_id: str) -> tuple[int, int]:
        """(handles, bytes) quarantined for ``session_id``."""
        held = self._by_session.get(session_id)
        return (held[0], held[1]) if held else (0, 0)

    def hold(self, handle: Handle, session_id: str, last_heard: float) -> None:
        self._held[handle.id] = _Held(handle, session_id, last_heard)
        self.chunks += len(handle.objs)
        held = self._by_session.setdefault(session_id, [0, 0])
        held[0] += 1
        held[1] += handle.nbytes
        _log.warning("quarantine", "lmkv server: handle %d of session %s ended while its "
                     "client may still copy (%d chunks); its buffers are quarantined until "
                     "the client is gone", handle.id, session_id, len(handle.objs))

    def release(self, session_id: str, handle_id: int, req_id: int | None = None) -> int | None:
        """The client is done with ``handle_id`` (lent to its request ``req_id``, when
        given): chunks freed, or None if not held here."""
        held = self._held.get(handle_id)
        if held is None or held.session_id != session_id or \
                (req_id is not None and held.handle.req_id != req_id):
            return None
        return self._free(handle_id)

    def release_request(self, session_id: str, req_id: int) -> int:
        ids = [i for i, h in self._held.items()
               if h.session_id == session_id and h.handle.req_id == req_id]
        return sum(self._free(i) for i in ids)

    def release_session(self, session_id: str) -> int:
        """The client ended its session: it copies nothing any more."""
        ids = [i for i, h in self._held.items() if h.session_id == session_id]
        return sum(self._free(i) for i in ids)

    def sweep(self, last_seen: Callable[[str], float | None]) -> int:
        """Free what belongs to clients now known gone; chunks freed.

        ``last_seen(session_id)``: when a live session of that id was last heard.
        """
        if not self._held:
            return 0
        now = time.monotonic()
        states: dict[str, str] = {}
        gone = []
        for handle_id, held in self._held.items():
            process = held.handle.process
            state = states.get(process)
            if state is None:
                state = states[process] = process_state(process) if process else "unknown"
            if state == "unknown":
                heard = max(held.last_heard, last_seen(held.session_id) or 0.0)
                if now - heard < self.grace_s:
                    continue
            elif state == "alive":
                continue
            gone.append(handle_id)
        freed = sum(self._free(i) for i in gone)
        if freed:
            logger.info("lmkv server: freed %d quarantined chunks of clients now gone", freed)
        return freed

    def _free(self, handle_id: int) -> int:
        held = self._held.pop(handle_id)
        by_session = self._by_session[held.session_id]
        by_session[0] -= 1
        by_session[1] -= held.handle.nbytes
        if not by_session[0]:
            del self._by_session[held.session_id]
        count = held.handle.release()
        self.chunks -= count
        return count

    def close(self) -> None:
        for handle_id in list(self._held):
            self._free(handle_id)
