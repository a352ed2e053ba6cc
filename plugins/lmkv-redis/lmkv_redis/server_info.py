"""The server's memory figures (``INFO memory``), cached so stats stay cheap."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster

if TYPE_CHECKING:
    from lmkv_redis.backend import RedisBackend

logger = logging.getLogger(__name__)

REFRESH_S = 10.0


class ServerInfo:
    """``maxmemory`` and ``used_memory`` of the server (summed over a cluster's
    primaries), refreshed at most every ``REFRESH_S``; the last known figures
    while the server is unreachable."""

    def __init__(self, backend: RedisBackend) -> None:
        self.backend = backend
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
            if now - self._at < REFRESH_S or not self.backend.usable:
                return
            self._at = now
            try:
                client = self.backend.client()
                if isinstance(client, RedisCluster):
                    reply = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                else:
                    reply = client.info("memory")
                sections = _per_node(reply)
            except Exception as exc:
                if not self.backend.faults.expected(exc):
                    raise
                self.backend.faults.record("INFO memory", exc, "keeping the last figures")
                return
            limits = [int(s.get("maxmemory", 0)) for s in sections]
            self._maxmemory = sum(limits) if limits and all(limits) else None
            self._used = sum(int(s.get("used_memory", 0)) for s in sections)


def _per_node(reply: Any) -> list[dict[str, Any]]:
    """One INFO dict per server: a cluster client answers ``{node: info}``."""
    if reply and all(isinstance(v, dict) for v in reply.values()):
        return list(reply.values())
    return [reply]
