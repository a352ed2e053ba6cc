"""``RemoteEngine``: the ``Engine`` over an ``lmkv server``'s tiers (``mode: server``;
opened by ``lmkv.engines.open_engine``).

The engine process keeps only its GPU connector; the tiers live in the
server. Chunks move without a staging copy: a store gathers the KV straight
into buffers the server lends (views of its shared-memory arena on this
machine), a retrieve scatters straight out of the arena into the engine's
KV. Keys are built here exactly as ``LocalEngine`` builds them, so both modes
name the same chunk the same way.

Lookups for the async lookup channel (``lookup_and_prefetch_hashes``, and
``lookup_and_prefetch`` for in-process callers that have the tokens) start
a prefetch on the server and resolve their future when the server has the
chunks; a background thread polls the pending ones. The prefetch is held in
this engine's session, so ``retrieve(..., lookup_id=...)`` takes it from there.

Block-granular hits (``lmkv.keys.aliases``) work as in ``LocalEngine``: stores send
each chunk's leading blocks' hashes, which the server stores as aliases of the
chunk; lookups and retrieves send them too, and the server serves the longest
stored leading blocks of the first chunk missed whole. That chunk may hold more
tokens than the hit (the stored chunk those blocks lead): the engine uses its
leading ones.

Every chunk a retrieve gets is checked against the engine's KV spec, as in
``LocalEngine``: one that does not fit ends the hit there (``spec_mismatches``)
and the server is asked to remove it (the ``drop`` request: it checks the entry
itself, then removes it from its tiers, counted as a corrupt frame), so the
next lookup of any of its clients misses there.

Nothing here raises because of the server: a server that is down, slow or
refusing makes lookups answer 0, retrieves load nothing and stores drop
(counted in ``client.counters``), and the client reconnects by itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import ChunkSpan, GPUConnector, KVSpec
from lmkv.engines.keys import engine_chunker, fits_spec
from lmkv.engines.protocol import EngineCounters, RetrieveResult
from lmkv.keys.chunking import CacheKey, ChunkKeys, Identity, KeyMeta
from lmkv.rpc.auth import client_keys
from lmkv.rpc.client import ServerClient

logger = logging.getLogger(__name__)
_drop_log = RateLimitedLog(logger)

POLL_INTERVAL_S = 0.0005


class RemoteEngine:
    def __init__(self, config: LMKVConfig, spec: KVSpec, *, model_name: str,
                 connector: GPUConnector, world_size: int = 1, worker_id: int = 0,
                 block_size: int | None = None) -> None:
        self.config = config
        self.spec = spec
        self.connector = connector
        self.chunker = engine_chunker(config, spec, model_name, connector, world_size,
                                      worker_id, block_size)
        self.counters = EngineCounters()
        server = config.server
        curve = client_keys(server.curve) if server.curve is not None else None
        self.client = ServerClient(server.address, timeout_ms=server.timeout_ms,
                                   data_path=server.data_path, curve=curve)
        # Lookups and their polls use their own connection (same session, so the
        # prefetches are this engine's): a retrieve never queues behind a poll.
        self._lookups = ServerClient(server.address, session=self.client.session,
                                     timeout_ms=server.timeout_ms, data_path="inline",
                                     curve=curve, releases=self.client.releases)
        if self.client.ping() is None:  # maps the arena now, not on the first load
            logger.warning("lmkv: no lmkv server answers at %s yet; misses until one does",
                           server.address)
        self._pending: dict[str, Future] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name="lmkv-remote-poll",
                                        daemon=True)
        self._poller.start()

    @property
    def block_size(self) -> int | None:
        """Tokens per block of block-granular hits; None: hits in whole chunks."""
        return self.chunker.block_size

    @property
    def meta(self) -> KeyMeta:
        return self.chunker.meta

    # -- store -------------------------------------------------------------------
    def store(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None,
              **kv: Any) -> int:
        """Store the KV of ``tokens``' chunks the server lacks; returns tokens stored."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        if not len(chunks):
            return 0
        shapes = [self.spec.chunk_shape(e - s) for s, e in zip(chunks.starts, chunks.ends,
                                                               strict=True)]
        filled: list[int] = []

        def fill(first: int, buffers: list[torch.Tensor]) -> None:
            spans = [ChunkSpan(chunks.starts[first + i], chunks.ends[first + i], buf)
                     for i, buf in enumerate(buffers)]
            self.connector.to_chunks(spans, **kv)
            filled.append(first)

        stored = self.client.store_from(chunks.keys, shapes, self.spec.dtype, fill,
                                        partial_hashes=self._partial_hashes(chunks))
        if not stored or not filled:
            return 0
        first = filled[0]
        return chunks.ends[first + stored - 1] - chunks.starts[first]

    # -- lookup ------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None) -> int:
        """Length in tokens of the longest prefix of ``tokens`` the server holds."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        if not len(chunks):
            return 0
        return self.client.lookup(chunks.keys, chunks.ends,
                                  partial_hashes=self._partial_hashes(chunks),
                                  block_tokens=self.chunker.block_size or 0)

    def _partial_hashes(self, chunks: ChunkKeys) -> list[list[bytes]] | None:
        """The hashes of each chunk's leading blocks (block-granular hits), else None."""
        if not self.chunker.block_size or not chunks.partials:
            return None
        return [[k.chunk_hash for k in keys] for keys in chunks.partials]

    def lookup_and_prefetch(self, tokens: Sequence[int] | Any, lookup_id: str, *,
                            identity: Identity | None = None) -> Future:
        """Have the server load the stored prefix of ``tokens`` and hold it for
        ``lookup_id``: ``Engine.lookup_and_prefetch`` over the server. Resolves to
        the hit length in tokens (0 when the server fails); ``retrieve(...,
        lookup_id=lookup_id)`` then loads what it holds, ``release_lookup`` drops it."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        return self.lookup_and_prefetch_hashes(lookup_id, [k.chunk_hash for k in chunks.keys],
                                               chunks.ends, self._partial_hashes(chunks) or (),
                                               self.chunker.block_size or 0)

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: Sequence[bytes],
                                   chunk_ends: Sequence[int],
                                   partial_hashes: Sequence[Sequence[bytes]] = (),
                                   block_tokens: int = 0) -> Future:
        """Have the server load the stored prefix and hold it for ``lookup_id``; the
        future resolves to the hit length in tokens (0 when the server fails).
        ``partial_hashes[i]``: chunk ``i``'s leading blocks' hashes, blocks of
        ``block_tokens`` (block-granular hits; none: whole chunks)."""
        future: Future = Future()
        if not chunk_hashes:
            future.set_result(0)
            return future
        # Only blocks of this engine's size, as in process: the answer is counted in them.
        blocks = (partial_hashes if partial_hashes and block_tokens == self.chunker.block_size
                  else None)
        # Chunks the server has at once come lent with the answer when this process
        # maps its arena: the retrieve that loads them asks the server nothing.
        hit = self._lookups.start_lookup_hashes(self.meta, chunk_hashes, chunk_ends,
                                                lookup_id, partial_hashes=blocks,
                                                block_tokens=block_tokens if blocks else 0,
                                                lend=self.client.shared_memory)
        if hit is not None:
            future.set_result(hit)
            return future
        with self._cond:
            old = self._pending.pop(lookup_id, None)
            self._pending[lookup_id] = future
            self._cond.notify()
        if old is not None:
            old.set_result(0)
        return future

    def release_lookup(self, lookup_id: str) -> None:
        with self._cond:
            future = self._pending.pop(lookup_id, None)
        if future is not None:
            future.set_result(0)
        if not self._lookups.release_lent(lookup_id):  # (else the server holds nothing more)
            self._lookups.release_lookup(lookup_id)

    def _poll_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                ids = list(self._pending)
            for lookup_id in ids:
                state = self._lookups.prefetch_status(lookup_id)
                if state is None:
                    continue
                with self._cond:
                    future = self._pending.pop(lookup_id, None)
                if future is not None:  # released meanwhile otherwise
                    future.set_result(max(state, 0))
            with self._cond:
                if self._pending and not self._closed:
                    self._cond.wait(POLL_INTERVAL_S)

    # -- retrieve ----------------------------------------------------------------
    def retrieve(self, tokens: Sequence[int] | Any, *, lookup_id: str | None = None,
                 identity: Identity | None = None, **kv: Any) -> RetrieveResult:
        """Load the KV of the stored prefix of ``tokens`` (what ``lookup_id``
        prefetched, when given) through the connector, straight from the server.
        A chunk whose shape or dtype does not fit this engine ends the hit there, and
        the server is asked to remove it (``_drop_misfit``).
        With block-granular hits the prefix may end inside a chunk (its longest
        stored leading blocks), and a chunk may hold more tokens than it is asked
        for (the stored chunk those blocks lead): its leading ones are loaded."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        if not len(chunks):
            return RetrieveResult(0, None)
        result: list[Any] = [None]
        ends = list(chunks.ends)
        fitting = [0]
        misfit: list[tuple[CacheKey, int]] = []  # the key a misfit was served under, its tokens

        def consume(views: list[torch.Tensor], tail_tokens: int = 0) -> None:
            keys = list(chunks.keys)  # what each view was served under
            if tail_tokens:  # the last view is a partial hit: its leading tokens
                last = len(views) - 1
                if tail_tokens <= chunks.ends[last] - chunks.starts[last]:
                    ends[last] = chunks.starts[last] + tail_tokens
                    keys[last] = self._partial_key(chunks, last, tail_tokens) or keys[last]
                else:  # more than the chunk has: not this prompt's
                    views = views[:last]
            spans = []
            for i, view in enumerate(views):
                want = ends[i] - chunks.starts[i]
                # A chunk may hold more tokens (an alias's target), never more than a chunk.
                if view.dim() == 5 and want < view.shape[2] <= self.config.chunk_size:
                    view = view.narrow(2, 0, want)
                if not fits_spec(self.spec, self.counters, keys[i], view, want):
                    misfit.append((keys[i], want))
                    break
                spans.append(ChunkSpan(chunks.starts[i], ends[i], view))
            fitting[0] = len(spans)
            if spans:
                result[0] = self.connector.from_chunks(spans, **kv)

        spans = [e - s for s, e in zip(chunks.starts, chunks.ends, strict=True)]
        if self.chunker.block_size:  # the last chunk may come whole (an alias's target)
            spans[-1] = max(spans[-1], self.config.chunk_size)
        expected = sum(self.spec.chunk_nbytes(n) for n in spans)
        n = self.client.retrieve_into(chunks.keys, consume, lookup_id=lookup_id or "",
                                      expected_bytes=expected,
                                      partial_hashes=self._partial_hashes(chunks),
                                      block_tokens=self.chunker.block_size or 0,
                                      lent=self._lookups.take_lent(lookup_id)
                                      if lookup_id else None)
        n = min(n, fitting[0])
        if misfit:  # once the lease is back: the server reads the entry again
            self._drop_misfit(*misfit[0])
        return RetrieveResult(ends[n - 1] if n else 0, result[0] if n else None)

    def _partial_key(self, chunks: ChunkKeys, index: int, tokens: int) -> CacheKey | None:
        """The key of chunk ``index``'s leading ``tokens`` (block-granular hits): the
        one the server serves a partial hit under."""
        block = self.chunker.block_size
        partials = chunks.partials[index] if block and index < len(chunks.partials) else []
        blocks = tokens // block if block else 0
        return partials[blocks - 1] if 0 < blocks <= len(partials) else None

    def _drop_misfit(self, key: CacheKey, tokens: int) -> None:
        """Ask the server to remove the entry under ``key`` that does not fit this
        engine's KV (it checks the entry against what this engine expects, then
        drops it from every tier, counted as corrupt once), so that the next lookup
        of any client misses there instead of hitting what never loads. A server
        that does not answer leaves it for the next retrieve."""
        outcome = self.client.drop(key, self.spec.chunk_shape(tokens), self.spec.dtype,
                                   chunk_tokens=self.config.chunk_size)
        if outcome == "kept":
            _drop_log.warning("kept", "lmkv: the lmkv server kept chunk %s: it holds the "
                              "KV this engine expects under that key", key.to_string())

    # -- the rest ----------------------------------------------------------------
    def stats(self) -> list[dict[str, Any]]:
        reply = self.client.stats()
        return [] if reply is None else list(reply.tiers)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
            self._cond.notify_all()
        for future in pending.values():
            future.set_result(0)
        self._poller.join(2.0)
        self._lookups.release_all_lent()
        self._lookups.close(end_session=False)  # (the session is the client's)
        self.client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
