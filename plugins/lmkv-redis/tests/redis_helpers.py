"""Keys and chunks for the redis tier's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
import torch

from lmkv.contracts import CacheKey, KeyMeta, MemoryObj, StorageBackend, tensor_obj

META = KeyMeta("redis-test", 1, 0, "float16", "l2thd")
SHAPE = (2, 2, 16, 2, 32)  # 8 KiB of float16


def key(i: int, meta: KeyMeta = META) -> CacheKey:
    return CacheKey(meta, i.to_bytes(4, "little") * 8)


def chunk(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.float16)


def put(tier: StorageBackend, ids: list[int], shape: tuple[int, ...] = SHAPE
        ) -> list[torch.Tensor]:
    """Store chunk ``i`` under ``key(i)`` for each id; returns the data stored."""
    data = [chunk(i, shape) for i in ids]
    objs = [tensor_obj(d) for d in data]
    stored = tier.batched_submit_put([key(i) for i in ids], objs).result(timeout=30)
    assert stored == len(ids)
    return data


def get(tier: StorageBackend, i: int) -> torch.Tensor | None:
    """The chunk under ``key(i)`` (a copy), or None; releases the tier's object."""
    obj: MemoryObj | None = tier.get_blocking(key(i))
    if obj is None:
        return None
    try:
        return obj.tensor.clone()
    finally:
        obj.ref_down()


@contextmanager
def count_sends(tier: StorageBackend) -> Iterator[list[int]]:
    """Counts the times the tier's connections send to a server: one per round trip
    and server (a pipeline sends once; a per-key loop would send once per key)."""
    client = tier.connection.client()
    if hasattr(client, "get_nodes"):
        pool = client.get_nodes()[0].redis_connection.connection_pool
    else:
        pool = client.connection_pool
    cls = pool.connection_class
    original = cls.send_packed_command
    own = "send_packed_command" in vars(cls)
    sends = [0]

    def counting(self: object, command: object, check_health: bool = True) -> None:
        sends[0] += 1
        original(self, command, check_health)

    cls.send_packed_command = counting
    try:
        yield sends
    finally:
        if own:
            cls.send_packed_command = original
        else:
            del cls.send_packed_command


def keys_of(client: redis.Redis, pattern: str = "*") -> list[bytes]:
    return sorted(client.scan_iter(match=pattern, count=1000))
