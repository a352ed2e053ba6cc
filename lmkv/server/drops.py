"""The ``drop`` request: a client found an entry that is not the KV its key names.

An entry under the right key with another shape or dtype (a frame written by a
misconfigured writer, or behind lmkv's back) is a hit for every lookup and never
loads. The client that read it asks for it to go (``lmkv.engines.remote``); the
server reads the entry itself (the first tier that holds it, as a read would
find it) and removes it (``StorageManager.drop``: from every tier, counted once
in ``corrupt_frames``) only if it differs from what the client says the key's
tokens should be. A client that says otherwise of a sound entry gets ``kept``.

Clients of one server may store under any key anyway, so a client that lies can
only remove what it could overwrite: a miss for the others, never another
request's KV.

The read goes through the storage manager's prefetch (off the server's loop,
bounded like any read) and the check and removal run on its thread when the
read is done: a lower tier's time is never the loop's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future

import torch

from lmkv.base.logutil import RateLimitedLog
from lmkv.memory import dtype_name, release
from lmkv.rpc import protocol as p
from lmkv.server.sessions import Session
from lmkv.storage.manager import StorageManager

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

TOKEN_AXIS = 2  # of a 5-dimension KV chunk: layers, K/V or heads, tokens, heads or K/V, head size


def entry_misfit(entry: torch.Tensor, dtype: torch.dtype, shape: list[int],
                 chunk_tokens: int) -> str | None:
    """How ``entry`` differs from a chunk of ``dtype`` and ``shape``, or None when it is
    one. An entry of up to ``chunk_tokens`` tokens (more than ``shape`` has) is
    compared by its leading ones, as an engine loads it (a block-granular hit's chunk)."""
    got = list(entry.shape)
    if len(got) == len(shape) == 5 and shape[TOKEN_AXIS] < got[TOKEN_AXIS] <= chunk_tokens:
        got[TOKEN_AXIS] = shape[TOKEN_AXIS]
    if entry.dtype == dtype and got == shape:
        return None
    return (f"is {dtype_name(entry.dtype)} {list(entry.shape)}, the client expects "
            f"{dtype_name(dtype)} {shape}")


class Drops:
    """The server's ``drop`` handler and its counters."""

    def __init__(self, storage: StorageManager, max_chunk_bytes: int) -> None:
        self.storage = storage
        self.max_chunk_bytes = max_chunk_bytes
        self.dropped = 0
        self.refused = 0
        self._lock = threading.Lock()  # the counters move on prefetch threads
        self._ids = itertools.count(1)

    def start(self, session: Session, req: p.Drop) -> Future:
        """Check ``req`` (ProtocolError: bad_request) and start reading the entry; the
        future resolves to the outcome (``p.DropOutcome``) once it is checked and,
        when it differs, dropped."""
        dtype = p.dtype_of(req.dtype)
        p.check_shape(req.shape, dtype.itemsize, self.max_chunk_bytes)
        probe = session.lookup_key(f"\x00drop-{next(self._ids)}")
        read = self.storage.lookup_and_prefetch(probe, [req.key], [0])
        outcome: Future = Future()

        def check(_: Future) -> None:
            try:
                outcome.set_result(self._decide(session, req, dtype, probe))
            except BaseException as exc:  # the reply says so: an internal error
                outcome.set_exception(exc)

        read.add_done_callback(check)
        return outcome

    def _decide(self, session: Session, req: p.Drop, dtype: torch.dtype, probe: str
                ) -> p.DropOutcome:
        objs = self.storage.take_prefetched(probe, longer=True) or []
        try:
            if not objs:
                return "absent"
            misfit = entry_misfit(objs[0].tensor, dtype, req.shape, req.chunk_tokens)
        finally:
            release(objs)
        if misfit is None:
            with self._lock:
                self.refused += 1
            _log.warning("kept", "lmkv server: session %s asked to drop %s, which is the "
                         "%s %s it expects: kept", session.id, req.key.to_string(), req.dtype,
                         req.shape)
            return "kept"
        self.storage.drop(req.key, f"not the KV its key names (a client's drop): it {misfit}")
        with self._lock:
            self.dropped += 1
        return "dropped"
