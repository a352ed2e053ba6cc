"""The ``peer`` tier with a directory in a real redis-server: instances register
what they store and read from whoever holds it; stale, foreign and expired
entries, a holder gone and the directory down are misses, never errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmkv.fleet.directory import RedisDirectory
from lmkv.storage import StorageManager
from lmkv.testing.redis import RedisServer, require_redis
from tests.fleet.test_peer_tier import build, keys, read, store, wait_until


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> list[str]:
    return [f"ipc://{tmp_path}/fleet/{name}.sock" for name in ("a", "b", "c")]


def member(fleet: list[str], me: str | None, url: str, **extra: object) -> StorageManager:
    return build(me, fleet, directory=url, **extra)


def registered(directory: RedisDirectory, ks: list) -> bool:  # type: ignore[type-arg]
    return all(directory.holders(ks[i:i + 1])[0] for i in range(len(ks)))


def test_a_reader_finds_what_another_instance_holds(fleet, redis_server) -> None:
    a = member(fleet, fleet[0], redis_server.url)
    b = member(fleet, fleet[1], redis_server.url)
    try:
        ks = keys(24, salt=20)
        store(a, ks)
        directory = a.tiers[1].directory
        assert wait_until(lambda: registered(directory, ks))
        # nothing was pushed: every chunk stayed with the instance that stored it
        assert not any(b.tiers[0].contains(k) for k in ks)
        assert b.contains_prefix(ks) == len(ks)
        assert read(b, ks) == [True] * len(ks)
        assert a.tiers[1].endpoint.served >= len(ks)
    finally:
        a.close()
        b.close()


def test_stale_foreign_and_expired_entries_are_misses(fleet, redis_server) -> None:
    a = member(fleet, fleet[0], redis_server.url, directory_ttl_s=1.0)
    b = member(fleet, fleet[1], redis_server.url)
    try:
        ks = keys(6, salt=21)
        store(a, ks)
        directory = a.tiers[1].directory
        assert wait_until(lambda: registered(directory, ks))
        # stale: a dropped the first chunk behind the directory's back
        assert a.tiers[0].remove(ks[0])
        assert b.contains_prefix(ks) == 0
        assert b.get(ks) == []
        # foreign: an address that is not one of the fleet's is never asked
        client = redis_server.client()
        client.sadd(directory._name(ks[1]), "tcp://10.9.9.9:1")
        assert directory.holders(ks[1:2]) == [[fleet[0]]]
        # expired: registrations go away by themselves
        assert wait_until(lambda: directory.holders(ks[1:2]) == [[]], timeout=5)
        assert b.contains_prefix(ks[1:]) == 0
    finally:
        a.close()
        b.close()


def test_a_holder_gone_and_the_directory_down_are_misses(fleet, redis_server) -> None:
    a = member(fleet, fleet[0], redis_server.url)
    b = member(fleet, fleet[1], redis_server.url)
    c = member(fleet, fleet[2], redis_server.url)
    try:
        ks = keys(8, salt=22)
        store(a, ks)
        assert wait_until(lambda: registered(a.tiers[1].directory, ks))
        a.close()
        start = time.monotonic()
        assert b.contains_prefix(ks) == 0
        assert time.monotonic() - start < 3.0
        # the directory down: misses, counted, and back once it is
        store(c, keys(4, salt=23))
        assert wait_until(lambda: registered(c.tiers[1].directory, keys(4, salt=23)))
        redis_server.kill()
        start = time.monotonic()
        assert b.contains_prefix(keys(4, salt=23)) == 0
        assert b.get(keys(4, salt=23)) == []
        assert time.monotonic() - start < 5.0
        assert b.tiers[1].stats()["errors"] >= 1
        redis_server.start()  # empty again: what is stored from now on is found
        more = keys(4, salt=24)
        store(c, more)
        assert wait_until(lambda: b.contains_prefix(more) == len(more), timeout=10)
        assert read(b, more) == [True] * len(more)
    finally:
        for manager in (a, b, c):
            manager.close()


def test_a_hung_directory_costs_one_timeout_then_is_skipped(fleet, redis_server) -> None:
    b = member(fleet, fleet[1], redis_server.url, retry_after_s=30)
    try:
        ks = keys(4, salt=25)
        redis_server.pause()
        try:
            start = time.monotonic()
            assert b.contains_prefix(ks) == 0
            first = time.monotonic() - start
            start = time.monotonic()
            for _ in range(5):
                assert b.contains_prefix(ks) == 0
            assert time.monotonic() - start < first, "the directory is skipped meanwhile"
            store(b, ks)  # registrations are dropped, counted, not queued
            assert b.tiers[1].stats()["dropped_writes"] >= len(ks)
        finally:
            redis_server.resume()
    finally:
        b.close()


def test_a_remove_reaches_the_holders(fleet, redis_server) -> None:
    a = member(fleet, fleet[0], redis_server.url)
    b = member(fleet, fleet[1], redis_server.url)
    try:
        ks = keys(2, salt=26)
        store(a, ks)
        assert wait_until(lambda: registered(a.tiers[1].directory, ks))
        assert b.tiers[1].remove(ks[0])
        assert not a.tiers[0].contains(ks[0]) and a.tiers[0].contains(ks[1])
    finally:
        a.close()
        b.close()
