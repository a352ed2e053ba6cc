"""Fixtures: real redis-server processes (a server, a cluster, TLS) and tier factories."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmkv.contracts import BackendContext, MemoryAllocator
from lmkv.testing.redis import RedisCluster, RedisServer, make_tls_files, require_redis
from lmkv.testing.tiers import serializer, strict_refcounts
from lmkv_redis import RedisBackend, RedisOptions


@pytest.fixture(autouse=True)
def _strict_refcounts() -> Iterator[None]:
    """A double release is a bug: raise in tests instead of logging."""
    with strict_refcounts():
        yield


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LMKV_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the whole run (tests keep apart by key prefix)."""
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    """A TLS-only redis-server and the CA file that verifies it."""
    require_redis()
    directory = tmp_path_factory.mktemp("tls")
    cert, key = make_tls_files(directory)
    server = RedisServer(directory / "server", tls=True, args=[
        "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]).start()
    yield server, cert
    server.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, to kill, pause or restart."""
    require_redis()
    server = RedisServer(tmp_path / "own").start()
    yield server
    server.stop()


@pytest.fixture
def arena() -> MemoryAllocator:
    return MemoryAllocator(64 << 20, pin_memory=False)


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make_tier(arena: MemoryAllocator) -> Iterator[Callable[..., RedisBackend]]:
    """``make_tier(url, **options)``: a redis tier with its own key prefix, closed after."""
    made: list[RedisBackend] = []

    def make(url: str, **options: object) -> RedisBackend:
        options.setdefault("key_prefix", unique_prefix())
        tier = RedisBackend(RedisOptions(url=url, **options),
                            BackendContext(serializer=serializer("naive"),
                                           allocate=arena.allocate))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
