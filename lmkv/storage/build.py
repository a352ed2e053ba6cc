"""The config's tiers, built from its resolved plugins, memory first.

A tier that stores bytes (fs, redis, mooncake) decodes what it reads into
buffers from ``BackendContext.allocate``: the arena of the tier that holds
memory (``holds_memory_objs``, the cpu tier), wherever that tier sits in the
list. That tier is therefore built first and the others are handed its
``allocate`` when they are built (``ReadAllocate``), so no tier calls into a
list still being filled; the storage manager made over the tiers then takes
that ``allocate`` over, so a read into memory may give up queued writes as a
store does (``StorageManager.allocate``). Without a tier that holds memory
they are handed ``tensor_allocate``: plain tensors, which nothing keeps past
the read. The tier that holds memory is handed no ``allocate``: it allocates
from its own arena.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmkv.config.model import LMKVConfig
from lmkv.contracts.policy import EvictionContext
from lmkv.contracts.serde import SerializerContext
from lmkv.contracts.tier import ArenaPlacement, BackendContext, StorageBackend
from lmkv.memory import Allocate, MemoryObj, tensor_obj

logger = logging.getLogger(__name__)


def tensor_allocate(shape: Sequence[int], dtype: torch.dtype) -> MemoryObj:
    """A chunk buffer that belongs to no arena (no tier holds memory)."""
    return tensor_obj(torch.empty(tuple(shape), dtype=dtype))


class ReadAllocate:
    """The ``allocate`` the tiers below the memory tier are handed: ``memory``'s
    own until ``target`` is set to another (the storage manager's, until it
    closes)."""

    __slots__ = ("memory", "target")

    def __init__(self, memory: StorageBackend) -> None:
        self.memory = memory
        self.target: Allocate = memory.allocate

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        return self.target(shape, dtype)


def memory_tier(tiers: Sequence[StorageBackend]) -> StorageBackend | None:
    """The first tier that holds memory, or None."""
    return next((t for t in tiers if t.holds_memory_objs), None)


def build_tiers(config: LMKVConfig, arena: ArenaPlacement = ArenaPlacement.PRIVATE,
                dry_run: bool = False) -> list[StorageBackend]:
    """The config's tiers in its order. ``arena`` is where the first tier that holds
    memory places its arena; the others' arenas stay private. ``dry_run``: each is
    told it is built only to be closed (``BackendContext.dry_run``). A tier that
    cannot start stops the start: the ones built before it are closed first."""
    plugins = config.plugins
    memory = next((i for i, t in enumerate(plugins.tiers) if t.backend.cls.holds_memory_objs),
                  None)
    order = sorted(range(len(plugins.tiers)), key=lambda i: i != memory)  # memory first
    built: dict[int, StorageBackend] = {}
    allocate: Allocate | ReadAllocate = tensor_allocate
    try:
        for i in order:
            tier = plugins.tiers[i]
            context = BackendContext(
                serializer=plugins.serializer.create(SerializerContext()),
                eviction_policy=tier.eviction.create(EvictionContext(tier_index=i)),
                allocate=None if i == memory else allocate,
                tier_index=i,
                arena=arena if i == memory else ArenaPlacement.PRIVATE,
                dry_run=dry_run,
                memory=None if i == memory or memory is None else built[memory],
            )
            built[i] = tier.backend.create(context)
            if i == memory:
                allocate = ReadAllocate(built[i])
    except BaseException:
        # Threads, connections and arenas of the tiers already built go back first.
        close_all(list(built.values()))
        raise
    return [built[i] for i in range(len(plugins.tiers))]


def close_all(tiers: Sequence[StorageBackend]) -> None:
    """Close ``tiers`` (last built first) after a start that failed; a tier whose
    ``close`` raises is logged and the others are closed still."""
    for made in reversed(tiers):
        try:
            made.close()
        except Exception:
            logger.exception("lmkv: closing tier %s after a failed start failed",
                             type(made).__name__)
