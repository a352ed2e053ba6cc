"""Promotion: the chunks a read got from lower tiers, stored in the first tier
once the read is over.

A read hands its chunks over tier by tier (``StorageManager.stream`` yields
each tier's as it completes): storing a lower tier's chunks in the first tier
inside that loop would hold every later hand-over back by the store. So the
read only collects them, with the chain of parents they had in their prompt
(a tier that evicts keeps a promoted prompt's head while its tail is stored),
and submits them in one put when it ends, without waiting for the put.

The collector takes its own reference on each chunk: the caller may release
its own as soon as it has them (and a read replaces an alias's entry by its
target, releasing the entry), while the put still needs them. Chunks a disk
tier left in place (``DirectChunk``) are never collected: they are not in
memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmkv.contracts.direct_chunk import memory_prefix
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj


class Promotion:
    """The lower-tier chunks one read collects for the first tier."""

    __slots__ = ("keys", "objs", "parents")

    def __init__(self) -> None:
        self.keys: list[CacheKey] = []
        self.objs: list[MemoryObj] = []
        self.parents: list[CacheKey | None] = []

    def add(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
            parents: Sequence[CacheKey | None]) -> None:
        """Collect the leading ``objs`` that are in memory (``keys`` and ``parents``
        are theirs, one each), each with a reference of its own."""
        n = memory_prefix(list(objs))
        for obj in objs[:n]:
            obj.ref_up()
        self.keys.extend(keys[:n])
        self.objs.extend(objs[:n])
        self.parents.extend(parents[:n])

    def take(self) -> tuple[list[CacheKey], list[MemoryObj], list[CacheKey | None]]:
        """What was collected (the caller now owns the references); empty after."""
        out = self.keys, self.objs, self.parents
        self.keys, self.objs, self.parents = [], [], []
        return out
