"""The lmkv storage contract, against a real server and a real 3-master cluster."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmkv.contracts import BackendContext, CacheKey, MemoryAllocator, StorageBackend
from lmkv.testing import StorageBackendConformance
from lmkv.testing.redis import RedisCluster, RedisServer
from lmkv.testing.tiers import serializer
from lmkv_redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.slow  # a real redis-server


class _RedisConformance(StorageBackendConformance):
    backend_class = RedisBackend
    url = ""
    options: dict = {}
    servers: list[RedisServer] = []

    def backend_options(self) -> dict:
        return {"url": self.url, "key_prefix": f"conf-{uuid.uuid4().hex[:8]}:", **self.options}

    def make_backend(self) -> StorageBackend:
        arena = MemoryAllocator(16 << 20, pin_memory=False)
        prefix = f"conf-{type(self).__name__}-{id(arena):x}:"
        return RedisBackend(RedisOptions(url=self.url, key_prefix=prefix, **self.options),
                            BackendContext(serializer=serializer("naive"),
                                           allocate=arena.allocate))

    def corrupt_entry(self, backend: StorageBackend, key: CacheKey) -> bool:
        """Flip a payload bit of the main value, with the tier's own client."""
        client = backend.connection.client()
        name = backend.connection.main_key(key)
        offset = client.strlen(name) - 10
        byte = client.getrange(name, offset, offset)[0]
        client.setrange(name, offset, bytes([byte ^ 1]))
        return True

    def copy_entry(self, backend: StorageBackend, source: CacheKey, target: CacheKey) -> bool:
        """Move the main value (a whole frame, or the envelope naming its parts)."""
        client, name = backend.connection.client(), backend.connection.main_key
        client.set(name(target), client.get(name(source)))
        return True

    #: How long the servers stay hung: longer than the block takes (one socket
    #: timeout, then the breaker answers), since nothing can end it early (a
    #: paused server holds its CLIENT UNPAUSE too).
    pause_s = 8.0

    @contextmanager
    def make_unreachable(self, backend: StorageBackend) -> Iterator[None]:
        """Every server hung for its clients (``CLIENT PAUSE ALL``: commands wait,
        the tier's time out; a cluster's bus goes on, so no failover), then
        serving again with what it held."""
        over = time.monotonic() + self.pause_s
        for server in self.servers:
            with server.client() as client:
                client.execute_command("CLIENT", "PAUSE", int(self.pause_s * 1000), "ALL")
        try:
            yield
        finally:
            time.sleep(max(0.0, over - time.monotonic()) + 0.1)


class TestRedisServer(_RedisConformance):
    @pytest.fixture(autouse=True)
    def _url(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url
        self.servers = [redis_server]


class TestRedisServerInParts(_RedisConformance):
    """Every entry split into 1 KiB parts (the chunks are 8 KiB)."""

    options = {"part_bytes": 1024}

    @pytest.fixture(autouse=True)
    def _url(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url
        self.servers = [redis_server]


class TestRedisCluster(_RedisConformance):
    options = {"cluster": True}

    @pytest.fixture(autouse=True)
    def _url(self, redis_cluster: RedisCluster) -> None:
        self.url = redis_cluster.url
        self.servers = redis_cluster.nodes


class TestRedisClusterInParts(_RedisConformance):
    options = {"cluster": True, "part_bytes": 1024}

    @pytest.fixture(autouse=True)
    def _url(self, redis_cluster: RedisCluster) -> None:
        self.url = redis_cluster.url
        self.servers = redis_cluster.nodes
