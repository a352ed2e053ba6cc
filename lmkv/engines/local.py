"""``LocalEngine``: the ``Engine`` over tiers in this process (``mode: in_process``;
opened by ``lmkv.engines.open_engine``).

``store(tokens, **kv)`` copies the KV of every whole chunk not yet stored into
chunk buffers (through the GPU connector) and hands them to the storage
manager; ``lookup(tokens)`` counts the hit prefix in tokens;
``retrieve(tokens, **kv)`` loads the hit prefix back into the engine's KV.

Each takes an optional ``identity`` (``lmkv.keys.chunking.Identity``: LoRA adapter,
cache salt, multimodal inputs, prompt embeddings): the same tokens under
another identity are other chunks. Every chunk a retrieve gets is checked
against the engine's KV spec (shape and dtype) before the connector sees it;
a chunk that does not fit ends the hit there (``counters.spec_mismatches``)
and is removed as the corrupt entry it is: its key names this engine's KV, so
whatever else is stored under it can never load. It is counted in the
``corrupt_frames`` of the tier that served it (the lowest that holds it: the
copies promoted above it go too), so the next lookup is a miss, not a hit
that never loads.

With ``record_metrics`` (the default) every lookup, retrieve and store is
recorded into the process's recorder (``lmkv.metrics``) and the engine's tiers
are a tier source; the vLLM connector opens its engine without it, since it
records the same figures in vLLM's terms.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec

from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import ChunkSpan, GPUConnector, KVSpec
from lmkv.contracts.direct_chunk import memory_prefix
from lmkv.engines.direct_loads import DirectLoads
from lmkv.engines.keys import engine_chunker, fits_spec, spec_misfit
from lmkv.engines.protocol import EngineCounters, RetrieveResult
from lmkv.keys.aliases import chunk_aliases
from lmkv.keys.chunking import CacheKey, ChunkKeys, Identity, KeyMeta, token_bytes
from lmkv.memory import MemoryObj, release
from lmkv.metrics import recorder
from lmkv.metrics.record import record_load, record_lookup, record_store
from lmkv.storage.manager import Partials, StorageManager, chain_parents

logger = logging.getLogger(__name__)
_store_log = RateLimitedLog(logger)

#: Lookups whose chunks are kept for their retrieve (the oldest go first).
LOOKUPS_KEPT = 32


class LocalEngine:
    def __init__(self, config: LMKVConfig, spec: KVSpec, *, model_name: str,
                 connector: GPUConnector, storage: StorageManager,
                 world_size: int = 1, worker_id: int = 0, block_size: int | None = None,
                 record_metrics: bool = True, direct_reads: bool = False) -> None:
        """``direct_reads``: the KV the connector copies into is in host memory and a
        load that fails part-way is recomputed by the caller (vLLM's CPU build), so
        lookups may leave chunks in a disk tier for ``retrieve`` to read straight
        into it (``lmkv.contracts.direct_chunk``)."""
        self.config = config
        self.spec = spec
        self.connector = connector
        self.storage = storage
        self.chunker = engine_chunker(config, spec, model_name, connector, world_size,
                                      worker_id, block_size)
        self.counters = EngineCounters()
        # The chunks of the last lookups, by lookup id, with the tokens and identity
        # they were made of: a retrieve of the same ones under that id reuses them.
        self._looked_up: dict[str, tuple[bytes, bytes, ChunkKeys]] = {}
        self._looked_up_lock = threading.Lock()
        storage.set_chunk_bytes(spec.chunk_nbytes(config.chunk_size))
        self.record_metrics = record_metrics
        self.direct = DirectLoads(connector) if direct_reads and connector.writes_in_place \
            else None
        if record_metrics:
            recorder().add_tier_source(self.stats)

    @property
    def block_size(self) -> int | None:
        """Tokens per block of block-granular hits; None: hits in whole chunks."""
        return self.chunker.block_size

    @property
    def meta(self) -> KeyMeta:
        return self.chunker.meta

    def store(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None,
              **kv: Any) -> int:
        """Store the KV of ``tokens``' chunks that the first tier does not hold yet (lower
        tiers are never asked: a slow one must not stall a store); returns tokens stored."""
        start = time.perf_counter()
        chunks = self.chunker.chunk(tokens, identity=identity)
        # Pin the stored prefix while this store allocates: its own allocations
        # must not evict the chunks it builds on.
        pinned = self.storage.pin_prefix(chunks.keys)
        try:
            stored = self._store_after(chunks, sum(len(ks) for _, ks in pinned), kv)
        finally:
            self.storage.unpin(pinned)
        if self.record_metrics and stored:
            record_store(stored, self.spec.chunk_nbytes(stored), start)
        return stored

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
            end = first + len(objs)
            keys = chunks.keys[first:end]
            self.storage.put(keys, objs,
                             chain_parents(keys, chunks.keys[first - 1] if first else None),
                             chunk_aliases(keys, chunks.partials[first:end]))
        finally:
            for obj in objs:
                obj.ref_down()
        return spans[-1].end - spans[0].start

    def lookup(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None) -> int:
        """Length in tokens of the longest stored prefix of ``tokens``."""
        start = time.perf_counter()
        chunks = self.chunker.chunk(tokens, identity=identity)
        hits = self.storage.contains_prefix(chunks.keys)
        if hits and chunks.ends[hits - 1] - chunks.starts[hits - 1] < self.chunker.chunk_size:
            # A block-aligned tail may be an alias whose chunk is gone: count it if read.
            obj = self.storage.read(chunks.keys[hits - 1])
            if obj is None:
                hits -= 1
            else:
                release([obj])
        hit = chunks.ends[hits - 1] if hits else 0
        tail = self._partial_hit(chunks, hits)
        if tail is not None:
            release([tail[1]])
            hit += tail[2]
        if self.record_metrics:
            record_lookup(len(tokens), hit, start)
        return hit

    def _partials(self, chunks: ChunkKeys) -> Partials | None:
        block = self.chunker.block_size
        return Partials(chunks.partials, block) if block and chunks.partials else None

    def _partial_hit(self, chunks: ChunkKeys, index: int
                     ) -> tuple[CacheKey, MemoryObj, int] | None:
        """Chunk ``index``'s longest stored leading blocks (block-granular hits)."""
        partials = self._partials(chunks)
        if partials is None or index >= len(chunks):
            return None
        return self.storage.partial_hit(partials, index)

    def lookup_and_prefetch(self, tokens: Sequence[int] | Any, lookup_id: str, *,
                            identity: Identity | None = None) -> Future:
        """Start loading the stored prefix of ``tokens`` from the tiers.

        Resolves to the hit length in tokens. A later ``retrieve(...,
        lookup_id=lookup_id)`` consumes the prefetched chunks instead of reading
        the tiers again; ``release_lookup`` drops them.
        """
        chunks = self.chunker.chunk(tokens, identity=identity)
        if chunks.keys:
            self._keep_chunks(lookup_id, tokens, identity, chunks)
        return self.storage.lookup_and_prefetch(lookup_id, chunks.keys, chunks.ends,
                                                partials=self._partials(chunks),
                                                direct=self.direct is not None)

    def _keep_chunks(self, lookup_id: str, tokens: Sequence[int] | Any,
                     identity: Identity | None, chunks: ChunkKeys) -> None:
        entry = (token_bytes(tokens).tobytes(), _identity_bytes(identity), chunks)
        with self._looked_up_lock:
            kept = self._looked_up
            kept.pop(lookup_id, None)
            if len(kept) >= LOOKUPS_KEPT:
                del kept[next(iter(kept))]
            kept[lookup_id] = entry

    def _chunks(self, tokens: Sequence[int] | Any, identity: Identity | None,
                lookup_id: str | None) -> ChunkKeys:
        """The chunks of ``tokens`` under ``identity``: those of lookup ``lookup_id``
        where it was of the same tokens and identity (byte for byte, as they are
        hashed), else made."""
        if lookup_id is not None:
            with self._looked_up_lock:
                kept = self._looked_up.pop(lookup_id, None)
            if kept is not None and kept[1] == _identity_bytes(identity) \
                    and kept[0] == token_bytes(tokens).tobytes():
                return kept[2]
        return self.chunker.chunk(tokens, identity=identity)

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: Sequence[bytes],
                                   chunk_ends: Sequence[int],
                                   partial_hashes: Sequence[Sequence[bytes]] = (),
                                   block_tokens: int = 0) -> Future:
        """``lookup_and_prefetch`` for chunk hashes computed elsewhere (the scheduler
        hashes once, identity included; each worker builds its own keys, with its
        own rank). ``partial_hashes[i]``: chunk ``i``'s leading blocks' hashes, of
        ``block_tokens`` tokens a block (block-granular hits; none: whole chunks)."""
        meta = self.chunker.meta
        keys = [CacheKey(meta, h) for h in chunk_hashes]
        # Only blocks of this engine's size: the answer is counted in them.
        partials = (Partials([[CacheKey(meta, h) for h in hs] for hs in partial_hashes],
                             block_tokens)
                    if partial_hashes and block_tokens == self.chunker.block_size else None)
        return self.storage.lookup_and_prefetch(lookup_id, keys, chunk_ends,
                                                partials=partials,
                                                direct=self.direct is not None)

    def release_lookup(self, lookup_id: str) -> None:
        with self._looked_up_lock:
            self._looked_up.pop(lookup_id, None)
        self.storage.release_prefetched(lookup_id)

    def retrieve(self, tokens: Sequence[int] | Any, *, lookup_id: str | None = None,
                 identity: Identity | None = None, **kv: Any) -> RetrieveResult:
        """Load the KV of the stored prefix of ``tokens`` through the connector.

        With a connector that writes into the engine's own KV (paged caches),
        chunks are copied in tier by tier as each tier delivers them, so an
        upper tier's copy overlaps a lower tier's read. Otherwise the connector
        builds the KV once every chunk is in (``RetrieveResult.kv``).
        """
        start = time.perf_counter()
        result = self._retrieve(tokens, lookup_id, identity, kv)
        if self.record_metrics and result.num_tokens:
            record_load(result.num_tokens, self.spec.chunk_nbytes(result.num_tokens), start)
        return result

    def _retrieve(self, tokens: Sequence[int] | Any, lookup_id: str | None,
                  identity: Identity | None, kv: dict[str, Any]) -> RetrieveResult:
        chunks = self._chunks(tokens, identity, lookup_id)
        objs = self.storage.take_prefetched(lookup_id, chunks.keys) if lookup_id else None
        if objs is None and self.connector.writes_in_place:
            return self._retrieve_streaming(chunks, kv)
        ends = list(chunks.ends)
        keys = list(chunks.keys)  # what each obj was served under
        if objs is None:
            objs = self.storage.get(chunks.keys)
            tail = self._partial_hit(chunks, len(objs))
            if tail is not None:
                objs.append(tail[1])
                ends[len(objs) - 1] = chunks.starts[len(objs) - 1] + tail[2]
                keys[len(objs) - 1] = tail[0]
        fitting = self._fitting(chunks, 0, objs, ends, keys)
        if not fitting:
            release(objs)
            return RetrieveResult(0, None)
        try:
            spans = [ChunkSpan(s, e, t)
                     for s, e, t in zip(chunks.starts, ends, fitting, strict=False)]
            if memory_prefix(objs) < len(spans):  # chunks left in a disk tier
                assert self.direct is not None
                loaded = self.direct.load(spans, objs, kv)
                return RetrieveResult(spans[loaded - 1].end if loaded else 0, None)
            result = self.connector.from_chunks(spans, **kv)
        finally:
            release(objs)
        return RetrieveResult(spans[-1].end, result)

    def _retrieve_streaming(self, chunks: ChunkKeys, kv: dict[str, Any]) -> RetrieveResult:
        hit = 0
        whole = True  # every chunk streamed so far fitted
        with contextlib.closing(self.storage.stream(chunks.keys)) as stream:
            for first, got in stream:
                hit, whole = self._copy_in(chunks, first, got, chunks.ends, kv)
                if not whole:
                    break
        end = chunks.ends[hit - 1] if hit else 0
        if whole and hit < len(chunks):
            tail = self._partial_hit(chunks, hit)
            if tail is not None:
                ends = list(chunks.ends)
                ends[hit] = chunks.starts[hit] + tail[2]
                keys = list(chunks.keys)
                keys[hit] = tail[0]
                if self._copy_in(chunks, hit, [tail[1]], ends, kv, keys)[1]:
                    end = ends[hit]
        return RetrieveResult(end, None)

    def _copy_in(self, chunks: ChunkKeys, first: int, got: list[MemoryObj],
                 ends: Sequence[int], kv: dict[str, Any],
                 keys: Sequence[CacheKey] | None = None) -> tuple[int, bool]:
        """Copy chunks ``first``... into the engine's KV; (chunks now in, all fitted)."""
        try:
            fitting = self._fitting(chunks, first, got, ends, keys or chunks.keys)
            spans = [ChunkSpan(chunks.starts[first + i], ends[first + i], t)
                     for i, t in enumerate(fitting)]
            if spans:
                self.connector.from_chunks(spans, **kv)
        finally:
            release(got)
        return first + len(fitting), len(fitting) == len(got)

    def _fitting(self, chunks: ChunkKeys, first: int, objs: list[MemoryObj],
                 ends: Sequence[int], keys: Sequence[CacheKey]) -> list[Any]:
        """The tensors of the leading ``objs`` (chunks ``first``..., served under
        ``keys``) whose shape and dtype are what this engine's KV spec gives their
        tokens (``ends``), a chunk that holds more tokens (block-granular hits: an
        alias's target, never more than a chunk) cut to its leading ones. The first
        that does not fit is counted and removed from the tiers (``_drop_misfit``);
        the caller releases every obj."""
        out = []
        spec = self.spec
        starts, chunk_size = chunks.starts, self.chunker.chunk_size
        for i, obj in enumerate(objs):
            j = first + i
            want = ends[j] - starts[j]
            tensor = obj.tensor
            shape = tensor.shape
            if len(shape) == 5 and want < shape[2] <= chunk_size:
                tensor = tensor.narrow(2, 0, want)
                shape = tensor.shape
            # (fits_spec's test first, without its calls: this runs per chunk)
            if (tensor.dtype != spec.dtype or shape != spec.chunk_shape(want)) \
                    and not fits_spec(spec, self.counters, keys[j], tensor, want):
                self._drop_misfit(keys[j], spec_misfit(self.spec, tensor, want))
                break
            out.append(tensor)
        return out

    def _drop_misfit(self, key: CacheKey, misfit: str | None) -> None:
        """Remove the entry under ``key`` that does not fit this engine's KV from every
        tier (``StorageManager.drop``: counted once, where a lookup found it), so
        the next lookup misses."""
        self.storage.drop(key, f"does not fit this engine's KV: it {misfit}")

    def stats(self) -> list[dict[str, Any]]:
        return self.storage.stats()

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        self.storage.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity_bytes(identity: Identity | None) -> bytes:
    """``identity`` as the keys hash it (an empty one as none); equal identities
    that would hash apart (an int and a float of one value) differ here too."""
    return msgspec.msgpack.encode(identity) if identity else b""
