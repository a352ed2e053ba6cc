"""KV events: what lmkv's tiers store and evict, through vLLM's own publisher.

With ``--kv-events-config`` vLLM publishes its GPU prefix cache's
``BlockStored`` / ``BlockRemoved``; a KV-aware router (llm-d, Dynamo) matches
them by vLLM's block hashes. This module adds lmkv's tiers to that stream, one
``medium`` per tier (``medium_names``: ``lmkv:cpu``, ``lmkv:fs``), so a router
sees a prefix lmkv can load as well as one vLLM still holds.

Who does what (vLLM's connector event hooks):

* Scheduler (``block_names``): every store plan carries vLLM's hashes of the
  request's blocks (``request.block_hashes``, as vLLM publishes them), its LoRA
  adapter and the blocks' extra keys; only the scheduler has the request.
* Worker (``WorkerEvents``): before a store it maps each lmkv chunk key of the
  plan to the blocks the chunk covers; the storage manager tells it of every
  chunk a tier stores or drops (``StorageManager.watch``, any thread: queued).
  Each step (``get_kv_connector_kv_cache_events``) it turns those into events:
  a chunk stored in a tier = its blocks ``BlockStored`` there, a chunk evicted
  or removed = its blocks ``BlockRemoved`` there. Per tier, a block is counted
  by the stored chunks that cover it (a block-aligned partial chunk and the
  whole chunk that later extends it share blocks): announced when the first
  arrives, removed when the last leaves.
* Scheduler again (``SchedulerEvents``): the workers' events arrive with the
  step's output (``update_connector_output``); ``take_events`` hands them to
  vLLM's publisher. With several workers (tensor parallel) a block is stored
  when every worker reported it and removed when the first one did.

The key map is bounded (``MAP_CHUNKS`` chunks, least recently stored out
first). A chunk that falls out of it is announced removed from every tier
that holds it (a router may then miss a hit lmkv could serve, never count on
one it cannot name); a tier change to a chunk the map no longer knows is not
published. Chunks stored by another process (a restarted vLLM's disk tier, an
lmkv server) are never announced; in server mode lmkv publishes nothing (its
tiers, and their evictions, are in the server).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from lmkv.integrations.vllm.specs import BlockNames, StoreSpec
from lmkv.keys.chunking import CacheKey

logger = logging.getLogger(__name__)

#: Chunks whose vLLM block names a worker keeps (with their tokens: about
#: 4 bytes a token plus the hashes); see the module docstring for what falls out.
MAP_CHUNKS = 16384
#: Stored events the scheduler keeps while waiting for every worker to report them.
PENDING_EVENTS = 65536


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def medium_names(tier_names: Sequence[str]) -> list[str]:
    """The ``medium`` of each tier: ``lmkv:<tier type>``, with ``:<index>``
    added to every tier whose type appears more than once."""
    seen = Counter(name.lower() for name in tier_names)
    return [f"lmkv:{name.lower()}" + (f":{i}" if seen[name.lower()] > 1 else "")
            for i, name in enumerate(tier_names)]


# -- scheduler: name the blocks of a store plan -----------------------------------------
def block_names(request: Any, end: int, block_size: int) -> BlockNames | None:
    """vLLM's names of ``request``'s blocks below token ``end`` (None: vLLM
    hashed none of them)."""
    n = min(end // block_size, len(request.block_hashes))
    if n <= 0:
        return None
    lora = request.lora_request
    extra = None
    if (lora is not None or request.mm_features or request.cache_salt
            or getattr(request, "prompt_embeds", None) is not None):
        keys, mm_index = [], 0
        for i in range(n):
            block_keys, mm_index = generate_block_hash_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_index)
            keys.append(block_keys)
        extra = to_event_extra_keys(keys)
    return BlockNames([maybe_convert_block_hash(h) for h in request.block_hashes[:n]],
                      lora.adapter_id if lora is not None else None,
                      lora.name if lora is not None else None, extra)


# -- worker: tier changes -> events ----------------------------------------------------
@dataclass
class _Chunk:
    """What a stored chunk covers, in vLLM's names."""

    hashes: tuple[Any, ...]
    parent: Any  # the hash of the block before the first; None for a prompt's first
    tokens: array
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    tiers: set[int] = field(default_factory=set)  # the tiers that hold it


class LMKVKVEvents(KVConnectorKVEvents):
    """One worker's events of one step (vLLM moves it to the scheduler)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self.events = list(events or [])
        self.workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> LMKVKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []


class WorkerEvents:
    def __init__(self, storage: Any, chunker: Any, block_size: int,
                 map_chunks: int = MAP_CHUNKS) -> None:
        self.storage = storage
        self.chunker = chunker
        self.block_size = block_size
        self.map_chunks = map_chunks
        self.mediums = medium_names([tier.name for tier in storage.tiers])
        self._changes: deque[tuple[int, CacheKey, bool]] = deque()  # from any thread
        self._chunks: OrderedDict[CacheKey, _Chunk] = OrderedDict()
        self._counts: list[dict[Any, int]] = [{} for _ in storage.tiers]  # per tier
        self._out: list[KVCacheEvent] = []
        self._lock = threading.Lock()  # the map: stores name chunks on the lazy saver too
        watched = storage.watch(self._heard)
        logger.info("lmkv: publishing KV events of tiers %s",
                    ", ".join(self.mediums[i] for i in watched) or "(none can be watched)")

    @classmethod
    def attach(cls, engine: Any, block_size: int) -> WorkerEvents | None:
        """Events of ``engine``'s tiers; None when they are not in this process."""
        storage = getattr(engine, "storage", None)
        chunker = getattr(engine, "chunker", None)
        if storage is None or chunker is None or not hasattr(storage, "watch"):
            logger.warning("lmkv: vLLM publishes KV events, but this engine's tiers are "
                           "not in this process: lmkv publishes none")
            return None
        return cls(storage, chunker, block_size)

    def _heard(self, tier: int, key: CacheKey, stored: bool) -> None:
        self._changes.append((tier, key, stored))  # under the tier's lock: queue only

    def name(self, specs: Iterable[StoreSpec]) -> None:
        """Map the chunk keys of ``specs`` (before they are stored) to their blocks."""
        bs = self.block_size
        for spec in specs:
            names = spec.blocks
            if names is None:
                continue
            chunks = self.chunker.chunk(spec.token_ids, identity=spec.identity)
            with self._lock:
                for key, start, end in zip(chunks.keys, chunks.starts, chunks.ends,
                                           strict=True):
                    first, last = start // bs, end // bs
                    if start % bs or end % bs or last > len(names.hashes):
                        continue  # not whole vLLM blocks, or blocks vLLM did not hash
                    if key in self._chunks:
                        self._chunks.move_to_end(key)
                        continue
                    self._chunks[key] = _Chunk(
                        tuple(names.hashes[first:last]),
                        names.hashes[first - 1] if first else None,
                        array("i", spec.token_ids[start:end]), names.lora_id, names.lora_name,
                        names.extra_keys[first:last] if names.extra_keys else None)
                    if len(self._chunks) > self.map_chunks:
                        self._forget(self._chunks.popitem(last=False)[1])

    def take(self) -> LMKVKVEvents | None:
        """The events of the tier changes since the last call."""
        changes = []
        while self._changes:
            changes.append(self._changes.popleft())
        with self._lock:
            final: dict[tuple[int, CacheKey], bool] = {}  # a drop and re-store nets out
            for tier, key, stored in changes:
                if key in self._chunks:
                    final[tier, key] = stored
            for (tier, key), stored in final.items():
                chunk = self._chunks.get(key)
                if chunk is None or stored == (tier in chunk.tiers):
                    continue
                if stored:
                    chunk.tiers.add(tier)
                    self._stored(tier, chunk)
                else:
                    chunk.tiers.discard(tier)
                    self._removed(tier, chunk)
            out, self._out = self._out, []
        return LMKVKVEvents(out) if out else None

    def _stored(self, tier: int, chunk: _Chunk) -> None:
        counts = self._counts[tier]
        new = []
        for i, h in enumerate(chunk.hashes):
            n = counts.get(h, 0)
            counts[h] = n + 1
            if not n:
                new.append(i)
        bs = self.block_size
        for a, b in _runs(new):  # one event per run of blocks new to the tier
            self._out.append(BlockStored(
                block_hashes=list(chunk.hashes[a:b]),
                parent_block_hash=chunk.hashes[a - 1] if a else chunk.parent,
                token_ids=chunk.tokens[a * bs:b * bs].tolist(), block_size=bs,
                lora_id=chunk.lora_id, medium=self.mediums[tier], lora_name=chunk.lora_name,
                extra_keys=chunk.extra_keys[a:b] if chunk.extra_keys else None, group_idx=0))

    def _removed(self, tier: int, chunk: _Chunk) -> None:
        counts = self._counts[tier]
        gone = []
        for h in chunk.hashes:
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            else:
                counts.pop(h, None)
                gone.append(h)
        if gone:
            self._out.append(BlockRemoved(block_hashes=gone, medium=self.mediums[tier],
                                          group_idx=0))

    def _forget(self, chunk: _Chunk) -> None:
        """A chunk leaves the map: removed from every tier that holds it."""
        for tier in sorted(chunk.tiers):
            self._removed(tier, chunk)
        chunk.tiers.clear()

    def close(self) -> None:
        self.storage.watch(None)


def _runs(indexes: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted ``indexes`` as ``[start, end)`` pairs."""
    runs: list[tuple[int, int]] = []
    for i in indexes:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


# -- scheduler: the workers' events -> vLLM's publisher ---------------------------------
class SchedulerEvents:
    """Collects the workers' events (``update_connector_output``) for ``take_events``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, world_size)
        self._ready: list[KVCacheEvent] = []
        self._stored: OrderedDict[KVCacheEvent, int] = OrderedDict()  # -> workers so far
        self._removed: dict[KVCacheEvent, int] = {}

    def collect(self, events: Any) -> None:
        if not isinstance(events, LMKVKVEvents):
            return
        if self.world_size == 1:
            self._ready.extend(events.get_all_events())
            return
        for event in events.get_all_events():
            self._count(event)

    def _count(self, event: KVCacheEvent) -> None:
        """Stored once every worker stored it; removed when the first one did."""
        if isinstance(event, BlockStored):
            n = self._stored.pop(event, 0) + 1
            if n >= self.world_size:
                self._ready.append(event)
                return
            self._stored[event] = n
            while len(self._stored) > PENDING_EVENTS:
                self._stored.popitem(last=False)  # a worker that never stored it
            return
        n = self._removed.get(event, 0)
        if not n:
            self._ready.append(event)
            gone = set(getattr(event, "block_hashes", ()))
            for pending in [e for e in self._stored
                            if e.medium == event.medium and gone & set(e.block_hashes)]:
                del self._stored[pending]  # stored by some workers only, then evicted
        if n + 1 >= self.world_size:
            self._removed.pop(event, None)
        else:
            self._removed[event] = n + 1
            if len(self._removed) > PENDING_EVENTS:
                self._removed.pop(next(iter(self._removed)))

    def take(self) -> list[KVCacheEvent]:
        out, self._ready = self._ready, []
        return out
