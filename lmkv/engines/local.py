"""``LocalEngine``: the ``Engine`` over tiers in this process (``mode: in_process``;
opened by ``lmkv.engines.open_engine``).

``store(tokens, **kv)`` copies the KV of every whole chunk not yet stored into
chunk buffers (through the GPU connector) and hands them to the storage
manager; ``lookup(tokens)`` counts the hit prefix in tokens;
``retrieve(tokens, **kv)`` loads the hit prefix back into the engine's KV.

Each takes an optional ``identity`` (``lmkv.tokens.Identity``: LoRA adapter,
cache salt, multimodal inputs, prompt embeddings): the same tokens under
another identity are other chunks. Every chunk a retrieve gets is checked
against the engine's KV spec (shape and dtype) before the connector sees it;
a chunk that does not fit ends the hit there (``counters.spec_mismatches``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from lmkv.config import LMKVConfig
from lmkv.engines.keys import engine_chunker, fits_spec
from lmkv.engines.protocol import EngineCounters, RetrieveResult
from lmkv.gpu import ChunkSpan, GPUConnector, KVSpec
from lmkv.logutil import RateLimitedLog
from lmkv.memory import MemoryObj, release
from lmkv.storage import StorageManager, chain_parents
from lmkv.tokens import CacheKey, ChunkKeys, Identity, KeyMeta

logger = logging.getLogger(__name__)
_store_log = RateLimitedLog(logger)


class LocalEngine:
    def __init__(self, config: LMKVConfig, spec: KVSpec, *, model_name: str,
                 connector: GPUConnector, storage: StorageManager,
                 world_size: int = 1, worker_id: int = 0) -> None:
        self.config = config
        self.spec = spec
        self.connector = connector
        self.storage = storage
        self.chunker = engine_chunker(config, spec, model_name, connector, world_size,
                                      worker_id)
        self.counters = EngineCounters()
        storage.set_chunk_bytes(spec.chunk_nbytes(config.chunk_size))

    @property
    def meta(self) -> KeyMeta:
        return self.chunker.meta

    def store(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None,
              **kv: Any) -> int:
        """Store the KV of ``tokens``' chunks that the first tier does not hold yet (lower
        tiers are never asked: a slow one must not stall a store); returns tokens stored."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        # Pin the stored prefix while this store allocates: its own allocations
        # must not evict the chunks it builds on.
        pinned = self.storage.pin_prefix(chunks.keys)
        try:
            return self._store_after(chunks, sum(len(ks) for _, ks in pinned), kv)
        finally:
            self.storage.unpin(pinned)

    def _store_after(self, chunks: ChunkKeys, first: int, kv: dict[str, Any]) -> int:
        spans: list[ChunkSpan] = []
        objs: list[MemoryObj] = []
        for start, end in zip(chunks.starts[first:], chunks.ends[first:], strict=True):
            obj = self.storage.allocate(self.spec.chunk_shape(end - start), self.spec.dtype)
            if obj is None:
                _store_log.warning("no-room", "lmkv: no room for %d more chunks (everything "
                                   "evictable is in use); storing a shorter prefix",
                                   len(chunks) - first - len(objs))
                break
            objs.append(obj)
            spans.append(ChunkSpan(start, end, obj.tensor))
        if not objs:
            return 0
        try:
            self.connector.to_chunks(spans, **kv)
            keys = chunks.keys[first:first + len(objs)]
            self.storage.put(keys, objs,
                             chain_parents(keys, chunks.keys[first - 1] if first else None))
        finally:
            for obj in objs:
                obj.ref_down()
        return spans[-1].end - spans[0].start

    def lookup(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None) -> int:
        """Length in tokens of the longest stored prefix of ``tokens``."""
        chunks = self.chunker.chunk(tokens, identity=identity)
        hits = self.storage.contains_prefix(chunks.keys)
        return chunks.ends[hits - 1] if hits else 0

    def lookup_and_prefetch(self, tokens: Sequence[int] | Any, lookup_id: str, *,
                            identity: Identity | None = None) -> Future:
        """Start loading the stored prefix of ``tokens`` from the tiers.

        Resolves to the hit length in tokens. A later ``retrieve(...,
        lookup_id=lookup_id)`` consumes the prefetched chunks instead of reading
        the tiers again; ``release_lookup`` drops them.
        """
        chunks = self.chunker.chunk(tokens, identity=identity)
        return self.storage.lookup_and_prefetch(lookup_id, chunks.keys, chunks.ends)

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: Sequence[bytes],
                                   chunk_ends: Sequence[int]) -> Future:
        """``lookup_and_prefetch`` for chunk hashes computed elsewhere (the scheduler
        hashes once, identity included; each worker builds its own keys, with its
        own rank)."""
        meta = self.chunker.meta
        keys = [CacheKey(meta, h) for h in chunk_hashes]
        return self.storage.lookup_and_prefetch(lookup_id, keys, chunk_ends)

    def release_lookup(self, lookup_id: str) -> None:
        self.storage.release_prefetched(lookup_id)

    def retrieve(self, tokens: Sequence[int] | Any, *, lookup_id: str | None = None,
                 identity: Identity | None = None, **kv: Any) -> RetrieveResult:
        """Load the KV of the stored prefix of ``tokens`` through the connector.

        With a connector that writes into the engine's own KV (paged caches),
        chunks are copied in tier by tier as each tier delivers them, so an
        upper tier's copy overlaps a lower tier's read. Otherwise the connector
        builds the KV once every chunk is in (``RetrieveResult.kv``).
        """
        chunks = self.chunker.chunk(tokens, identity=identity)
        objs = self.storage.take_prefetched(lookup_id, chunks.keys) if lookup_id else None
        if objs is None and self.connector.writes_in_place:
            return self._retrieve_streaming(chunks, kv)
        if objs is None:
            objs = self.storage.get(chunks.keys)
        objs = self._fitting(chunks, 0, objs)
        if not objs:
            return RetrieveResult(0, None)
        try:
            spans = [ChunkSpan(s, e, o.tensor)
                     for s, e, o in zip(chunks.starts, chunks.ends, objs, strict=False)]
            result = self.connector.from_chunks(spans, **kv)
        finally:
            release(objs)
        return RetrieveResult(spans[-1].end, result)

    def _retrieve_streaming(self, chunks: ChunkKeys, kv: dict[str, Any]) -> RetrieveResult:
        hit = 0
        with contextlib.closing(self.storage.stream(chunks.keys)) as stream:
            for first, got in stream:
                objs = self._fitting(chunks, first, got)
                try:
                    spans = [ChunkSpan(chunks.starts[first + i], chunks.ends[first + i], o.tensor)
                             for i, o in enumerate(objs)]
                    if spans:
                        self.connector.from_chunks(spans, **kv)
                finally:
                    release(objs)
                hit = first + len(objs)
                if len(objs) < len(got):
                    break
        return RetrieveResult(chunks.ends[hit - 1] if hit else 0, None)

    def _fitting(self, chunks: ChunkKeys, first: int, objs: list[MemoryObj]
                 ) -> list[MemoryObj]:
        """The leading ``objs`` (chunks ``first``...) whose shape and dtype are what this
        engine's KV spec gives their tokens; the rest are released and counted."""
        for i, obj in enumerate(objs):
            j = first + i
            if not fits_spec(self.spec, self.counters, chunks.keys[j], obj.tensor,
                             chunks.ends[j] - chunks.starts[j]):
                release(objs[i:])
                return objs[:i]
        return objs

    def stats(self) -> list[dict[str, Any]]:
        return self.storage.stats()

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
