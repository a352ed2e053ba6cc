"""Redis Cluster specifics: parts share their entry's slot; entries spread over masters."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from redis_helpers import count_sends, get, key, put

from lmkv.testing.redis import RedisCluster
from lmkv_redis import RedisBackend
from lmkv_redis.layout import part_names

pytestmark = pytest.mark.slow  # a real redis-server

MakeTier = Callable[..., RedisBackend]


def test_every_part_lies_in_its_entrys_slot(redis_cluster: RedisCluster,
                                            make_tier: MakeTier) -> None:
    tier = make_tier(redis_cluster.url, cluster=True, part_bytes=1024)
    node = redis_cluster.nodes[0].client()
    for i in range(16):
        main = tier.connection.main_key(key(i))
        slots = {node.execute_command("CLUSTER", "KEYSLOT", name)
                 for name in [main, *part_names(tier.options.key_prefix, main, 9)]}
        assert len(slots) == 1
    data = put(tier, list(range(16)))
    assert all(torch.equal(get(tier, i), d) for i, d in enumerate(data))


def test_entries_spread_over_every_master(redis_cluster: RedisCluster,
                                          make_tier: MakeTier) -> None:
    tier = make_tier(redis_cluster.url, cluster=True)
    put(tier, list(range(64)))
    prefix = tier.options.key_prefix
    per_node = [sum(1 for _ in n.client().scan_iter(match=prefix + "*", count=1000))
                for n in redis_cluster.nodes]
    assert sum(per_node) == 64 and all(per_node)


def test_lookup_of_128_keys_is_one_round_trip_per_master(redis_cluster: RedisCluster,
                                                         make_tier: MakeTier) -> None:
    tier = make_tier(redis_cluster.url, cluster=True)
    put(tier, list(range(128)))
    keys = [key(i) for i in range(128)]
    assert tier.batched_async_contains("l", keys) == 128  # every node connected
    with count_sends(tier) as sends:
        assert tier.batched_async_contains("l", keys) == 128
    assert sends[0] == len(redis_cluster.nodes)


def test_capacity_sums_the_masters(redis_cluster: RedisCluster, make_tier: MakeTier) -> None:
    for node in redis_cluster.nodes:
        node.client().config_set("maxmemory", str(256 << 20))
    try:
        tier = make_tier(redis_cluster.url, cluster=True)
        assert tier.capacity_bytes == 3 * (256 << 20)
    finally:
        for node in redis_cluster.nodes:
            node.client().config_set("maxmemory", "0")
