from __future__ import annotations

import logging

import torch

from lmkv.base.logutil import RateLimitedLog
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey
from lmkv.storage.manager import StorageManager, chain_parents
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy
from tests.storage.tiers import SHAPE, cpu, fill, key


def test_lookup_and_get_are_a_strict_prefix_across_tiers() -> None:
    upper, lower = cpu(), cpu()
    fill(upper, [0, 1])
    fill(lower, [2, 3, 5])
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
    fill(lower, [0, 1, 2])
    manager = StorageManager([upper, lower])
    assert manager.contains_prefix([key(i) for i in range(3)]) == 3
    manager.close()


def test_put_goes_to_every_tier_and_a_failing_tier_never_raises(caplog) -> None:
    class Broken(CPUBackend):
        name = "broken"

        def batched_submit_put(self, keys, objs, parents=None):
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


# -- a hung lower tier never stalls a store ---------------------------------------------


def test_a_store_never_waits_on_a_hung_lower_tier() -> None:
    """The S3 endpoint accepts connections and never answers; its read timeout is
    30 s. A store goes to the cpu tier and queues the write-through: it returns
    at once (old code asked every tier what it held first, and waited)."""
    import threading
    import uuid

    from lmkv import KVSpec, load_config
    from lmkv.testing.engines import open_local_engine
    from tests.services import S3Endpoint

    endpoint = S3Endpoint()
    endpoint.start()
    endpoint.client().create_bucket(Bucket="hang")
    endpoint.hang()
    config = load_config(env={}, overrides={"lmkv.chunk_size": 16, "lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": 1 << 22}},
        {"type": "fs", "options": {
            "url": f"s3://hang/{uuid.uuid4().hex[:8]}", "endpoint_url": endpoint.url,
            "key": "testing", "secret": "testing", "connect_timeout_s": 30,
            "read_timeout_s": 30, "retries": 0, "close_timeout_s": 0}}]})
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    engine = open_local_engine(config, spec, model_name="hang-test")
    kv = [(torch.randn(1, 2, 64, 16).half(), torch.randn(1, 2, 64, 16).half())
          for _ in range(2)]
    stored: list[int] = []
    try:
        for _ in range(3):  # a fresh prompt each time: nothing to skip
            tokens = torch.randint(0, 50_000, (64,)).tolist()
            store = threading.Thread(target=lambda t=tokens: stored.append(
                engine.store(t, kv=kv)), daemon=True)
            store.start()
            store.join(timeout=2.0)  # against a 30 s hang
            assert not store.is_alive(), "a store waited on the hung lower tier"
        assert stored == [64, 64, 64]
    finally:
        endpoint.stop()  # ends the hung requests (their connections are reset)
        engine.close()


def test_a_get_that_times_out_gives_its_buffers_back_when_it_ends(monkeypatch) -> None:
    """The caller got a miss; the chunks the tier hands over later are nobody's and
    are released, so the arena does not leak and the entries stay evictable."""
    import threading
    from concurrent.futures import Future

    import lmkv.storage.manager

    tier = cpu()
    fill(tier, [0, 1])
    gate = threading.Event()
    late: Future = Future()
    real_get = tier.batched_get_non_blocking
    threads: list[threading.Thread] = []

    def slow_get(lookup_id, keys):  # type: ignore[no-untyped-def]
        def finish() -> None:
            gate.wait(5)
            late.set_result(real_get(lookup_id, keys).result())
        threads.append(threading.Thread(target=finish, daemon=True))
        threads[-1].start()
        return late

    monkeypatch.setattr(tier, "batched_get_non_blocking", slow_get)
    monkeypatch.setattr(lmkv.storage.manager, "GET_TIMEOUT_S", 0.05)
    storage = StorageManager([tier])
    try:
        assert storage.get([key(0), key(1)]) == []
        gate.set()
        threads[0].join(5)  # set_result runs the done-callbacks in that thread
        objs = late.result(5)
        assert len(objs) == 2
        assert all(obj.ref_count == 1 for obj in objs)  # only the tier's own reference
    finally:
        storage.close()


def _chunks(manager: StorageManager, ids: list[int]) -> list:
    objs = []
    for i in ids:
        obj = manager.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        objs.append(obj)
    return objs


def test_eviction_never_orphans_a_prefix() -> None:
    """A 4-chunk prompt fills a 4-chunk tier; one more store evicts the prompt's
    tail, never its head: the stored prefix stays 3 chunks long."""
    chunk = 4 * 2 * 2 * 8 * 2 * 8
    tier = cpu(max_bytes=4 * chunk)
    manager = StorageManager([tier])
    keys = [key(i) for i in range(4)]
    objs = _chunks(manager, range(4))
    manager.put(keys, objs, chain_parents(keys)).result()
    for obj in objs:
        obj.ref_down()
    for obj in manager.get(keys):  # reads refresh all four, head first
        obj.ref_down()
    other = _chunks(manager, [9])
    manager.put([key(9)], other, [None]).result()
    other[0].ref_down()
    assert [tier.contains(k) for k in keys] == [True, True, True, False]
    assert manager.contains_prefix(keys) == 3
    manager.close()


def test_chain_parents_links_each_chunk_to_the_one_before() -> None:
    keys = [key(i) for i in range(3)]
    assert chain_parents(keys) == [None, keys[0], keys[1]]
    assert chain_parents(keys[1:], keys[0]) == [keys[0], keys[1]]
    layered = [k.with_layer(layer) for k in keys[:2] for layer in range(2)]
    assert chain_parents(layered, keys_per_chunk=2) == [None, None, layered[0], layered[1]]
    before = keys[2].with_layer(0)
    assert chain_parents(layered[:2], before, 2) == [keys[2].with_layer(0),
                                                      keys[2].with_layer(1)]


def test_an_allocation_larger_than_the_leaves_evicts_in_passes() -> None:
    """One prompt of 4 chunks fills the tier: its only leaf is the last chunk. A
    buffer twice a chunk's size needs two evictions: the tail, then the chunk
    before it (a leaf once the tail went); the head stays."""
    chunk = 4 * 2 * 2 * 8 * 2 * 8
    tier = cpu(max_bytes=4 * chunk)
    keys = [key(i) for i in range(4)]
    objs = []
    for i in range(4):
        obj = tier.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        objs.append(obj)
    tier.batched_submit_put(keys, objs, chain_parents(keys)).result()
    for obj in objs:
        obj.ref_down()
    big = tier.allocate((2, *SHAPE), torch.float32)
    assert big is not None
    assert [tier.contains(k) for k in keys] == [True, True, False, False]
    big.ref_down()
    tier.close()


def test_watch_hears_every_chunk_a_tier_stores_and_drops_and_stops_when_told() -> None:
    """The listener hears stores, evictions and removals with the tier's index; a
    tier without a policy is not watched; None stops it (nothing heard after)."""
    chunk = 4 * 2 * 2 * 8 * 2 * 8
    tier = cpu(max_bytes=2 * chunk)
    bare = cpu()
    bare.context = BackendContext()  # no policy: cannot be watched
    manager = StorageManager([tier, bare])
    heard: list[tuple[int, CacheKey, bool]] = []
    assert manager.watch(lambda i, k, stored: heard.append((i, k, stored))) == [0]
    keys = [key(i) for i in range(3)]
    for k in keys:  # the third store evicts the first (a leaf: no parents here)
        objs = _chunks(manager, [0])
        manager.put([k], objs, [None]).result()
        objs[0].ref_down()
        # the write-through to the second tier holds a reference until it is done:
        # drained, every stored chunk is evictable when the next one is allocated
        manager.flush()
    tier.remove(keys[2])
    assert [(i, k, s) for i, k, s in heard if i == 0] == [
        (0, keys[0], True), (0, keys[1], True), (0, keys[0], False), (0, keys[2], True),
        (0, keys[2], False)]
    manager.watch(None)
    objs = _chunks(manager, [0])
    manager.put([key(7)], objs, [None]).result()
    objs[0].ref_down()
    assert len(heard) == 5
    manager.close()


def test_a_tier_that_cannot_start_closes_the_tiers_made_before_it(
        monkeypatch: object, tmp_path: object) -> None:
    import pytest

    from lmkv import load_config
    from lmkv.base.errors import ConfigError
    from lmkv_backends.tiers.fs import FSBackend

    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "1MiB"}},
        {"type": "fs", "options": {"url": str(tmp_path)}}]})
    closed: list[object] = []
    real_close = CPUBackend.close

    def close(self: CPUBackend) -> None:
        closed.append(self)
        real_close(self)

    def refuse(self: FSBackend, *args: object, **kwargs: object) -> None:
        raise ConfigError("config key 'tiers.1.options.url': refused by the test")

    monkeypatch.setattr(CPUBackend, "close", close)
    monkeypatch.setattr(FSBackend, "__init__", refuse)
    with pytest.raises(ConfigError, match="refused by the test"):
        StorageManager.from_config(config)
    assert len(closed) == 1 and isinstance(closed[0], CPUBackend)
