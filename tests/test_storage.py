from __future__ import annotations

import logging

import torch

from lmkv.backend import BackendContext
from lmkv.logutil import RateLimitedLog
from lmkv.storage import StorageManager
from lmkv.tokens import CacheKey, KeyMeta
from lmkv_backends.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy

SHAPE = (2, 2, 8, 2, 8)


def cpu(max_bytes: int = 1 << 20) -> CPUBackend:
    return CPUBackend(CPUBackend.Options(max_bytes=max_bytes),
                      BackendContext(eviction_policy=LRUPolicy()))


def key(i: int) -> CacheKey:
    return CacheKey(KeyMeta("m"), i.to_bytes(32, "little"))


def put(tier: CPUBackend, ids: list[int]) -> None:
    objs = []
    for i in ids:
        obj = tier.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        objs.append(obj)
    tier.batched_submit_put([key(i) for i in ids], objs).result()
    for obj in objs:
        obj.ref_down()


def test_lookup_and_get_are_a_strict_prefix_across_tiers() -> None:
    upper, lower = cpu(), cpu()
    put(upper, [0, 1])
    put(lower, [2, 3, 5])
    manager = StorageManager([upper, lower])
    keys = [key(i) for i in range(6)]
    assert manager.contains_prefix(keys) == 4
    objs = manager.get(keys)
    assert [int(o.tensor[0, 0, 0, 0, 0]) for o in objs] == [0, 1, 2, 3]
    for obj in objs:
        obj.ref_down()
    manager.close()


def test_a_lookup_that_misses_the_upper_tier_falls_through() -> None:
    upper, lower = cpu(), cpu()
    put(lower, [0, 1, 2])
    manager = StorageManager([upper, lower])
    assert manager.contains_prefix([key(i) for i in range(3)]) == 3
    manager.close()


def test_put_goes_to_every_tier_and_a_failing_tier_never_raises(caplog) -> None:
    class Broken(CPUBackend):
        name = "broken"

        def batched_submit_put(self, keys, objs):
            raise ConnectionError("tier down")

    upper = cpu()
    broken = Broken(Broken.Options(max_bytes=1 << 20), BackendContext(eviction_policy=LRUPolicy()))
    manager = StorageManager([upper, broken])
    obj = manager.allocate(SHAPE, torch.float32)
    with caplog.at_level(logging.WARNING):
        assert manager.put([key(1)], [obj]).result() == 1
        obj.ref_down()
        assert manager.flush(5)
    assert broken.counters.errors == 1
    assert "tier down" in caplog.text
    assert manager.contains_prefix([key(1)]) == 1
    manager.close()


def test_allocation_without_a_memory_tier_gives_plain_buffers() -> None:
    class NoMemory(CPUBackend):
        name = "no-memory"
        holds_memory_objs = False

    tier = NoMemory(NoMemory.Options(max_bytes=1 << 20),
                    BackendContext(eviction_policy=LRUPolicy()))
    obj = StorageManager([tier]).allocate(SHAPE, torch.float16)
    assert obj.allocator is None and tuple(obj.shape) == SHAPE
    obj.ref_down()


def test_rate_limited_log_counts_suppressed(caplog) -> None:
    log = RateLimitedLog(logging.getLogger("lmkv.test"), interval_s=3600)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            log.warning("k", "fault %d", i)
        log.warning("other", "other fault")
    assert caplog.text.count("fault 0") == 1
    assert "fault 1" not in caplog.text
    assert "other fault" in caplog.text
