"""Small cpu tiers filled with numbered chunks, for the storage tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy

SHAPE = (2, 2, 8, 2, 8)
NBYTES = 2 * 2 * 8 * 2 * 8 * 4  # one float32 chunk of SHAPE


def cpu(cls: type[CPUBackend] = CPUBackend, max_bytes: int = 1 << 20) -> CPUBackend:
    """A cpu tier (or a subclass) with an LRU policy."""
    return cls(cls.Options(max_bytes=max_bytes), BackendContext(eviction_policy=LRUPolicy()))


def key(i: int) -> CacheKey:
    return CacheKey(KeyMeta("m"), i.to_bytes(32, "little"))


def fill(tier: CPUBackend, ids: Iterable[int]) -> None:
    """Store chunk ``i`` (every element ``i``) under ``key(i)`` for each id."""
    ids = list(ids)
    objs = []
    for i in ids:
        obj = tier.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        objs.append(obj)
    tier.batched_submit_put([key(i) for i in ids], objs).result()
    for obj in objs:
        obj.ref_down()
