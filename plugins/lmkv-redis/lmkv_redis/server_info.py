"""The server's memory figures (``INFO memory``), cached so stats stay cheap."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis.cluster import RedisCluster

from lmkv_redis.connect import Client
from lmkv_redis.connection import Connection

logger = logging.getLogger(__name__)

REFRESH_S = 10.0


class ServerInfo:
    """``maxmemory`` and ``used_memory`` of the server (summed over a cluster's
    primaries), refreshed at most every ``REFRESH_S``; the last known figures
    while the server is unreachable."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._lock = threading.Lock()
        self._at = -REFRESH_S
        self._maxmemory: int | None = None
        self._used: int | None = None

    def maxmemory(self) -> int | None:
        self._refresh()
        return self._maxmemory

    def used_memory(self) -> int | None:
        self._refresh()
        return self._used

    def _refresh(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._at < REFRESH_S or not self.connection.usable:
                return
            self._at = now
            sections = None
            with self.connection.faults.guard("INFO memory", "keeping the last figures"):
                sections = _per_node(self.connection.call(_memory_info))
            if sections is None:
                return
            limits = [int(s.get("maxmemory", 0)) for s in sections]
            self._maxmemory = sum(limits) if limits and all(limits) else None
            self._used = sum(int(s.get("used_memory", 0)) for s in sections)


def _memory_info(client: Client) -> Any:
    if isinstance(client, RedisCluster):
        return client.info("memory", target_nodes=RedisCluster.PRIMARIES)
    return client.info("memory")


def _per_node(reply: Any) -> list[dict[str, Any]]:
    """One INFO dict per server: a cluster client answers ``{node: info}``."""
    if reply and all(isinstance(v, dict) for v in reply.values()):
        return list(reply.values())
    return [reply]
