"""A server that dies, comes back, hangs or runs out of patience: nothing raises."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from redis_helpers import chunk, get, key, put

from lmkv.contracts import tensor_obj
from lmkv.testing.processes import free_port
from lmkv.testing.redis import RedisServer
from lmkv_redis import RedisBackend

pytestmark = pytest.mark.slow  # a real redis-server

MakeTier = Callable[..., RedisBackend]
FAST = {"retry_after_s": 0.2, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5}


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_killed_server_then_restarted_on_the_same_port(own_server: RedisServer,
                                                       make_tier: MakeTier) -> None:
    tier = make_tier(own_server.url, part_bytes=4096, **FAST)
    put(tier, [0, 1])
    assert tier.batched_async_contains("l", [key(0), key(1)]) == 2
    own_server.kill()

    assert tier.batched_async_contains("l", [key(0), key(1)], pin=True) == 0
    assert get(tier, 0) is None
    assert tier.batched_get_non_blocking("l", [key(0)]).result(timeout=10) == []
    stored = tier.batched_submit_put([key(2)], [tensor_obj(chunk(2))]).result(timeout=10)
    assert stored == 0
    assert not tier.remove(key(0))
    stats = tier.stats()
    assert stats["errors"] >= 1 and stats["dropped_writes"] >= 1 and stats["misses"] >= 1

    own_server.start()  # same port, empty (no persistence)
    assert wait_for(lambda: tier.batched_submit_put(
        [key(3)], [tensor_obj(chunk(3))]).result(timeout=10) == 1)
    assert torch.equal(get(tier, 3), chunk(3))
    assert tier.contains(key(3)) and not tier.contains(key(0))


def test_server_killed_mid_workload(own_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(own_server.url, **FAST)
    errors: list[BaseException] = []
    hits_after_restart = threading.Event()
    restarted = threading.Event()
    stop = threading.Event()

    def workload() -> None:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                tier.batched_submit_put([key(i)], [tensor_obj(chunk(i))]).result(timeout=10)
                tier.batched_async_contains("l", [key(i), key(i - 1)], pin=True)
                tier.unpin(key(i))
                tier.unpin(key(i - 1))
                obj = tier.get_blocking(key(i))
                if obj is not None:
                    if not torch.equal(obj.tensor, chunk(i)):
                        raise AssertionError(f"wrong KV for chunk {i}")
                    obj.ref_down()
                    if restarted.is_set():
                        hits_after_restart.set()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=workload)
    thread.start()
    try:
        assert wait_for(lambda: tier.stats()["hits"] >= 20)
        own_server.kill()
        assert wait_for(lambda: tier.stats()["dropped_writes"] >= 3)
        own_server.start()
        restarted.set()
        assert hits_after_restart.wait(10)
    finally:
        stop.set()
        thread.join(30)
    assert not errors
    assert tier.stats()["errors"] >= 1


def test_close_is_prompt_with_a_hung_server(own_server: RedisServer,
                                            make_tier: MakeTier) -> None:
    tier = make_tier(own_server.url, socket_timeout_s=2.0, close_timeout_s=1.0)
    put(tier, [1])
    own_server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        future = tier.batched_submit_put([key(i) for i in range(2, 6)],
                                         [tensor_obj(chunk(i)) for i in range(2, 6)])
        t0 = time.monotonic()
        tier.close()
        took = time.monotonic() - t0
        assert 1.0 <= took < 4.0  # waited close_timeout_s for the put in flight, no more
        assert future.result(timeout=10) == 0
        assert tier.stats()["dropped_writes"] == 4
        assert not tier.contains(key(1))  # closed: a miss, no exception
    finally:
        own_server.resume()


def test_a_hung_server_costs_one_timeout_then_backs_off(own_server: RedisServer,
                                                        make_tier: MakeTier) -> None:
    tier = make_tier(own_server.url, socket_timeout_s=0.3, retry_after_s=30.0)
    put(tier, [1])
    own_server.pause()
    try:
        assert not tier.contains(key(1))
        errors = tier.stats()["errors"]
        assert errors == 1
        for _ in range(5):  # backing off: answered without touching the network
            assert tier.batched_async_contains("l", [key(1)]) == 0
            assert get(tier, 1) is None
        assert tier.stats()["errors"] == errors
    finally:
        own_server.resume()


def test_unreachable_server_at_start(make_tier: MakeTier) -> None:
    for cluster in (False, True):
        tier = make_tier(f"redis://127.0.0.1:{free_port()}/0", cluster=cluster, **FAST)
        assert tier.batched_async_contains("l", [key(1)]) == 0
        assert get(tier, 1) is None
        assert tier.batched_submit_put([key(1)], [tensor_obj(chunk(1))]).result(10) == 0
        assert tier.capacity_bytes is None
        assert tier.stats()["errors"] >= 1


def test_full_put_queue_drops_new_puts(own_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(own_server.url, max_pending_bytes=1, socket_timeout_s=1.0)
    put(tier, [0])
    own_server.pause()
    try:
        first = tier.batched_submit_put([key(1)], [tensor_obj(chunk(1))])
        second = tier.batched_submit_put([key(2)], [tensor_obj(chunk(2))])
        assert second.result(timeout=1) == 0  # refused at once, not queued
        assert first.result(timeout=10) == 0  # the hung server timed it out
        assert tier.stats()["dropped_writes"] == 2
    finally:
        own_server.resume()
