"""What lies in Redis and what a get makes of it: prefixes, TTL, parts, corruption."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from redis_helpers import SHAPE, chunk, count_sends, get, key, keys_of, put

from lmkv.contracts import MemoryAllocator, tensor_obj
from lmkv.testing.redis import RedisServer
from lmkv_redis import RedisBackend
from lmkv_redis.layout import ENVELOPE

pytestmark = pytest.mark.slow  # a real redis-server

MakeTier = Callable[..., RedisBackend]
FRAME_BYTES = 8192 + 88  # an 8 KiB chunk behind the naive serializer's 88-byte header


def test_key_prefix_keeps_namespaces_apart(redis_server: RedisServer,
                                           make_tier: MakeTier) -> None:
    a = make_tier(redis_server.url, key_prefix="ns-a:", part_bytes=1024)
    b = make_tier(redis_server.url, key_prefix="ns-b:")
    put(a, [1, 2])
    assert b.batched_async_contains("l", [key(1), key(2)]) == 0
    assert get(b, 1) is None
    assert not b.remove(key(1))
    server = redis_server.client()
    names = keys_of(server, "ns-*")
    assert names and all(n.startswith(b"ns-a:") for n in names)  # parts included
    assert a.batched_async_contains("l", [key(1), key(2)]) == 2
    assert a.remove(key(1)) and a.remove(key(2))
    assert keys_of(server, "ns-*") == []


def test_main_key_is_prefix_plus_key_string(redis_server: RedisServer,
                                            make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url, key_prefix="named:")
    put(tier, [3])
    assert keys_of(redis_server.client(), "named:*") == [
        ("named:" + key(3).to_string()).encode()]
    tier.remove(key(3))


def test_ttl_expires_every_part(redis_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url, ttl_s=0.5, part_bytes=1024)
    put(tier, [1])
    server = redis_server.client()
    names = keys_of(server, tier.options.key_prefix + "*")
    assert len(names) == 9  # ceil(8264 / 1024)
    assert all(0 < server.pttl(n) <= 500 for n in names)
    time.sleep(0.7)
    assert not tier.contains(key(1))
    assert get(tier, 1) is None


def test_large_values_are_split_and_reassembled(redis_server: RedisServer,
                                                make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url, part_bytes=1024)
    (data,) = put(tier, [5])
    server = redis_server.client()
    main = tier.connection.main_key(key(5))
    head = server.get(main)
    assert head[:4] == b"LMKR" and len(head) == ENVELOPE.size + 1024
    assert len(keys_of(server, tier.options.key_prefix + "*")) == 9
    assert torch.equal(get(tier, 5), data)
    assert tier.usage_bytes == FRAME_BYTES


def test_a_missing_part_is_a_miss_and_removes_the_entry(redis_server: RedisServer,
                                                        make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url, part_bytes=1024)
    put(tier, [1, 2])
    server = redis_server.client()
    prefix = tier.options.key_prefix
    part = next(n for n in keys_of(server, prefix + "*") if n.endswith(b"#4")
                and key(1).to_string().encode() in n)
    server.delete(part)
    assert tier.batched_async_contains("l", [key(1), key(2)]) == 2  # the main key is there
    objs = tier.batched_get_non_blocking("l", [key(1), key(2)]).result(timeout=10)
    assert objs == []  # a prefix: nothing after the broken entry either
    assert tier.stats()["misses"] >= 1
    assert not tier.contains(key(1))
    remaining = keys_of(server, prefix + "*")
    assert remaining and all(key(1).to_string().encode() not in n for n in remaining)
    assert get(tier, 2) is not None  # the next entry was left alone


CORRUPTIONS = {
    "bit flip in the payload": lambda c, name, v: c.setrange(name, len(v) - 100,
                                                            bytes([v[-100] ^ 0x10])),
    "bit flip in the header": lambda c, name, v: c.setrange(name, 20, bytes([v[20] ^ 1])),
    "truncated": lambda c, name, v: c.set(name, v[:-64]),
    "foreign string": lambda c, name, v: c.set(name, b"not kv at all"),
    "empty frame": lambda c, name, v: c.set(name, b"LMKV"),
    "foreign type": lambda c, name, v: (c.delete(name), c.rpush(name, b"x")),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_a_corrupt_value_is_a_removed_miss(redis_server: RedisServer, make_tier: MakeTier,
                                           corrupt: str) -> None:
    tier = make_tier(redis_server.url)
    put(tier, [1])
    server = redis_server.client()
    name = tier.connection.main_key(key(1))
    CORRUPTIONS[corrupt](server, name, server.get(name))
    assert get(tier, 1) is None
    stats = tier.stats()
    assert stats["corrupt_frames"] == 1 and stats["hits"] == 0
    assert not server.exists(name)
    put(tier, [1])  # the key works again afterwards
    assert torch.equal(get(tier, 1), chunk(1))


PART_CORRUPTIONS = {
    "bit flip in a part": lambda c, main, part: c.setrange(part, 10, bytes([c.get(part)[10] ^ 4])),
    "truncated part": lambda c, main, part: c.set(part, c.get(part)[:-1]),
    "envelope claims more parts": lambda c, main, part: c.setrange(main, 4, b"\x20"),
    "envelope claims another length": lambda c, main, part: c.setrange(main, 8, b"\x01\x01"),
}


@pytest.mark.parametrize("corrupt", list(PART_CORRUPTIONS), ids=list(PART_CORRUPTIONS))
def test_a_corrupt_part_is_a_removed_miss(redis_server: RedisServer, make_tier: MakeTier,
                                          corrupt: str) -> None:
    tier = make_tier(redis_server.url, part_bytes=1024)
    put(tier, [1])
    server = redis_server.client()
    main = tier.connection.main_key(key(1))
    part = next(n for n in keys_of(server, tier.options.key_prefix + "*") if n.endswith(b"#3"))
    PART_CORRUPTIONS[corrupt](server, main, part)
    assert get(tier, 1) is None
    assert tier.stats()["hits"] == 0
    assert keys_of(server, tier.options.key_prefix + "*") == []  # every part went


def test_lookup_of_128_keys_is_one_round_trip(redis_server: RedisServer,
                                              make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url)
    put(tier, list(range(128)))
    server = redis_server.client()
    server.config_resetstat()
    keys = [key(i) for i in range(128)]
    with count_sends(tier) as sends:
        assert tier.batched_async_contains("l", keys, pin=True) == 128
    assert sends[0] == 1
    assert server.info("commandstats")["cmdstat_getrange"]["calls"] == 128
    for k in keys:
        assert tier.unpin(k)


def test_a_pinned_get_fetches_every_part_in_one_round_trip(redis_server: RedisServer,
                                                           make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url, part_bytes=1024)
    data = put(tier, [0, 1, 2, 3])
    keys = [key(i) for i in range(4)]
    with count_sends(tier) as unpinned:
        objs = tier.batched_get_non_blocking("l", keys).result(timeout=10)
    assert len(objs) == 4 and unpinned[0] == 2  # the main values tell the part count
    for obj in objs:
        obj.ref_down()
    assert tier.batched_async_contains("l", keys, pin=True) == 4
    with count_sends(tier) as pinned:
        objs = tier.batched_get_non_blocking("l", keys).result(timeout=10)
    assert pinned[0] == 1
    assert all(torch.equal(o.tensor, d) for o, d in zip(objs, data, strict=True))
    for obj in objs:
        obj.ref_down()
    for k in keys:
        tier.unpin(k)


def test_puts_are_one_pipeline(redis_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url)
    assert not tier.contains(key(999))  # connects (the handshake sends too)
    assert tier._sweeping.acquire(timeout=10)  # the miss's empty-value check is done
    tier._sweeping.release()
    with count_sends(tier) as sends:
        put(tier, list(range(32)))
    assert sends[0] == 1


def test_usage_counts_what_this_process_added(redis_server: RedisServer,
                                              make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url)
    other = make_tier(redis_server.url, key_prefix=tier.options.key_prefix)
    put(tier, [1, 2])
    assert tier.usage_bytes == 2 * FRAME_BYTES
    put(other, [2])  # already there: adds nothing
    assert other.usage_bytes == 0
    assert tier.remove(key(1))
    assert tier.usage_bytes == FRAME_BYTES
    assert tier.stats()["bytes_in"] == 2 * FRAME_BYTES


def test_capacity_is_the_servers_maxmemory(own_server: RedisServer,
                                           make_tier: MakeTier) -> None:
    assert make_tier(own_server.url).capacity_bytes is None  # maxmemory 0: unlimited
    own_server.client().config_set("maxmemory", str(64 << 20))
    tier = make_tier(own_server.url)
    assert tier.capacity_bytes == 64 << 20
    assert tier.stats()["server_used_memory"] > 0


def test_a_full_server_drops_writes_and_leaves_no_parts(own_server: RedisServer,
                                                        make_tier: MakeTier) -> None:
    server = own_server.client()
    server.config_set("maxmemory", str(4 << 20))
    server.config_set("maxmemory-policy", "noeviction")
    tier = make_tier(own_server.url, part_bytes=256 << 10, pipeline_bytes=1 << 20)
    shape = (2, 2, 256, 8, 32)  # 1 MiB chunks, 5 parts each
    data = [chunk(i, shape) for i in range(8)]
    stored = tier.batched_submit_put([key(i) for i in range(8)],
                                     [tensor_obj(d) for d in data]).result(timeout=30)
    assert 0 < stored < 8
    stats = tier.stats()
    assert stats["dropped_writes"] == 8 - stored and stats["errors"] >= 1
    present = 0
    for i in range(8):
        got = get(tier, i)
        if got is None:  # a refused entry left nothing behind: no orphaned parts
            assert not any(key(i).to_string().encode() in n for n in keys_of(server))
        else:
            assert torch.equal(got, data[i])
            present += 1
    assert present == stored


def test_objects_are_referenced_until_written(redis_server: RedisServer,
                                              make_tier: MakeTier) -> None:
    arena = MemoryAllocator(1 << 20, pin_memory=False)
    tier = make_tier(redis_server.url)
    obj = arena.allocate(SHAPE, torch.float16)
    obj.tensor.copy_(chunk(4))
    future = tier.batched_submit_put([key(4)], [obj])
    obj.ref_down()  # the caller lets go at once; the tier still holds its own reference
    assert future.result(timeout=10) == 1
    assert arena.used_bytes == 0 and arena.live_objects == 0
    assert torch.equal(get(tier, 4), chunk(4))
