"""Fixtures: real redis-server processes (a server, a cluster, TLS) and tier factories."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis_servers import REDIS_CLI, REDIS_SERVER, RedisCluster, RedisServer, make_tls_files

import lmkv.memory
from lmkv import BackendContext
from lmkv.memory import MemoryAllocator
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_redis import RedisBackend, RedisOptions


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli are not installed")


@pytest.fixture(autouse=True)
def _strict_refcounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A double release is a bug: raise in tests instead of logging."""
    monkeypatch.setattr(lmkv.memory, "strict_refcounts", True)


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LMKV_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the whole run (tests keep apart by key prefix)."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    _need_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    """A TLS-only redis-server and the CA file that verifies it."""
    _need_redis()
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
    _need_redis()
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
                            BackendContext(serializer=NaiveSerializer(), allocate=arena.allocate))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
