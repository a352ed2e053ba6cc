"""One replay: a trace through a real ``StorageManager`` and real tiers, as an
engine would drive them, nothing computed.

Per request: a real retrieve of the stored prefix through the manager (its
``stream``, as an engine whose connector writes in place reads; hits = the
leading chunks it returns: strict prefix, as vLLM counts), released at once;
then the engine's store path: pin the prefix the first tier holds, allocate a
buffer for every chunk after it (allocation evicts, in the policy's order), put
them with their parents in one batch, release, unpin.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import TextIO

import torch

from lmkv.base.errors import LMKVError
from lmkv.base.units import parse_byte_size
from lmkv.config.model import LMKVConfig, PluginRef
from lmkv.contracts.serde import SerializerContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryObj, release, tensor_obj
from lmkv.replay.defaults import PHYSICAL_CHUNK_BYTES
from lmkv.replay.trace import Trace
from lmkv.storage.manager import StorageManager, chain_parents

# A chunk of KV has a dimension per layer, head and token: never one run of bytes,
# the shape of an alias (lmkv.keys.aliases), which every read checks for.
_SHAPE = (1, PHYSICAL_CHUNK_BYTES)
_DTYPE = torch.uint8


@dataclass
class TierTraffic:
    """What one tier did in a run, in chunks (bytes: at the model's size)."""

    tier: int
    type: str
    chunks_written: int
    chunks_read: int
    evictions: int
    dropped_writes: int


@dataclass
class RunResult:
    policy: str
    capacity_chunks: int
    chunk_requests: int
    hits: int
    chunks_stored: int
    chunks_unstored: int  # missed, but no buffer could be had: the request's store stopped
    seconds: float
    tiers: list[TierTraffic] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.chunk_requests if self.chunk_requests else 0.0

    @property
    def chunk_ops(self) -> int:
        """Chunk operations the manager served: every chunk looked up, plus every
        chunk stored."""
        return self.chunk_requests + self.chunks_stored


class Progress:
    """A line on ``stream`` (stderr) every ``every_s`` seconds of a long run; none
    for a run that ends sooner."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None,
                 every_s: float = 3.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.stream = stream if stream is not None else sys.stderr
        self._next = time.monotonic() + every_s

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every_s
            print(f"lmkv replay: {self.label}: {done}/{self.total} requests",
                  file=self.stream, flush=True)


def sized_config(config: LMKVConfig, policy: str, capacity_chunks: int,
                 model_chunk_bytes: int) -> LMKVConfig:
    """``config`` with every tier evicting by ``policy`` (its options kept when the
    config names the same policy), the first tier holding ``capacity_chunks``
    chunks, and each lower tier's ``max_bytes`` (read at the model's size) turned
    into as many chunks. A chunk takes ``PHYSICAL_CHUNK_BYTES`` in a tier that holds
    memory, and its frame (``frame_bytes``) in one that stores frames (fs)."""
    sized = config.model_copy(deep=True)
    frame = None
    for i, (tier, resolved) in enumerate(zip(sized.tiers, config.plugins.tiers, strict=True)):
        if tier.eviction.type.lower() != policy.lower():
            tier.eviction = PluginRef(type=policy)
        backend = resolved.backend.cls
        takes_size = "max_bytes" in backend.Options.model_fields
        if i == 0:
            if not takes_size:
                raise LMKVError(f"tier 0 ({tier.type}) has no max_bytes option: lmkv replay "
                                "sizes the first tier; use a config whose first tier is cpu "
                                "or fs")
            chunks = capacity_chunks
        elif takes_size and tier.options.get("max_bytes") is not None:
            chunks = max(1, parse_byte_size(tier.options["max_bytes"]) // model_chunk_bytes)
        else:
            continue
        if backend.holds_memory_objs:
            per_chunk = PHYSICAL_CHUNK_BYTES
        else:
            frame = frame or frame_bytes(config)
            per_chunk = frame
        tier.options = {**tier.options, "max_bytes": chunks * per_chunk}
    return sized


def frame_bytes(config: LMKVConfig) -> int:
    """The bytes one replayed chunk's frame takes with ``config``'s serializer (a
    compressing one makes the zeros a replay stores small: they are what is stored)."""
    serializer = config.plugins.serializer.create(SerializerContext())
    obj = tensor_obj(torch.zeros(_SHAPE, dtype=_DTYPE))
    key = CacheKey(KeyMeta("lmkv-replay"), bytes(32))
    return len(serializer.frame_bytes(obj, key))


class ReplayFailed(Exception):
    """A run could not finish as lmkv would serve it: its figures mean nothing."""


def replay(trace: Trace, config: LMKVConfig, policy: str, capacity_chunks: int, *,
           model_chunk_bytes: int, progress: Callable[[int], None] | None = None
           ) -> RunResult:
    """Replay ``trace`` once through fresh tiers sized to ``capacity_chunks``.

    Raises ReplayFailed when a tier or its policy raised what no storage fault
    explains (the storage manager served misses instead: the hit ratio would
    be the bug's, not the policy's)."""
    storage = StorageManager.from_config(
        sized_config(config, policy, capacity_chunks, model_chunk_bytes))
    try:
        for i, tier in enumerate(storage.tiers):
            if tier.usage_bytes:
                raise LMKVError(f"tier {i} ({tier.name}) already holds chunks: lmkv replay "
                                "needs empty tiers (point the config at an empty directory "
                                "or database)")
        started = time.perf_counter()
        hits, stored, unstored = _run(storage, trace, progress)
        seconds = time.perf_counter() - started
        broken = next((t for t in storage.tiers if t.faults.bugs), None)
        if broken is not None:  # a put or get the storage manager had to absorb
            raise ReplayFailed(f"tier {storage.tiers.index(broken)} ({broken.name}): "
                               f"{broken.faults.first_bug}")
        traffic = [TierTraffic(i, tier.name, tier.counters.puts, tier.counters.hits,
                               tier.counters.evictions, tier.counters.dropped_writes)
                   for i, tier in enumerate(storage.tiers)]
        _forget(storage, trace)
    finally:
        storage.close()
    return RunResult(policy, capacity_chunks, trace.chunk_requests, hits, stored, unstored,
                     seconds, traffic)


def _run(storage: StorageManager, trace: Trace, progress: Callable[[int], None] | None
         ) -> tuple[int, int, int]:
    keys_of = trace.keys
    allocate, stream, put, pin_prefix, unpin = (storage.allocate, storage.stream,
                                                storage.put, storage.pin_prefix,
                                                storage.unpin)
    flush = storage.flush if len(storage.tiers) > 1 else None
    hits = stored = unstored = 0
    zeroed: set[tuple[int, int]] = set()
    for done, chunks in enumerate(trace.requests):
        if progress is not None and not done % 64:
            progress(done)
        keys = [keys_of[c] for c in chunks]
        with closing(stream(keys)) as fetched:
            for _, got in fetched:
                hits += len(got)
                release(got)
        pinned = pin_prefix(keys)
        try:
            first = sum(len(ks) for _, ks in pinned)
            objs: list[MemoryObj] = []
            for _ in range(first, len(keys)):
                obj = allocate(_SHAPE, _DTYPE)
                if obj is None:  # everything evictable is in use: a shorter prefix
                    unstored += len(keys) - first - len(objs)
                    break
                # Zeros, never what the memory held before: a frame's size (compressed)
                # must be what sized_config counted, in every run. An arena slot is
                # zeroed once; the replay never writes it after.
                slot = (id(obj.allocator), obj.offset)
                if obj.allocator is None or slot not in zeroed:
                    obj.tensor.zero_()
                    zeroed.add(slot)
                objs.append(obj)
            if objs:
                end = first + len(objs)
                stored_keys = keys[first:end]
                # Waited for: a tier that writes in the background (fs) must have
                # stored (and evicted) before the next request looks, every run alike.
                put(stored_keys, objs,
                    chain_parents(stored_keys, keys[first - 1] if first else None)).result()
                release(objs)
                stored += len(objs)
        finally:
            unpin(pinned)
        if flush is not None:
            flush()
    if progress is not None:
        progress(len(trace.requests))
    return hits, stored, unstored


def _forget(storage: StorageManager, trace: Trace) -> None:
    """Remove what the run stored from tiers that outlive it (files, a database), so
    the next run starts empty too; memory tiers go with the manager."""
    for tier in storage.tiers:
        if not tier.holds_memory_objs:
            for key in trace.keys:
                tier.remove(key)


