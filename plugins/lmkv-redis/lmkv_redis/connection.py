"""The redis tier's link to Redis: one object the reader, the writer and the
server figures share instead of the backend.

It owns the redis-py client (made on first use: a cluster client contacts the
cluster then), names the keys, and puts the tier's breaker around every
round trip: ``pipeline`` and ``command`` refuse at once while it is open
(``lmkv.contracts.faults.BreakerOpen``), an answered round trip closes it. It never
holds the backend, so nothing here forms a cycle with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.client import Pipeline
from redis.exceptions import RedisClusterException

from lmkv.contracts import CacheKey, TierFaults
from lmkv_redis.connect import Client, make_client
from lmkv_redis.options import RedisOptions

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Everything a Redis call can fail with at run time: a miss or a dropped write.
FAULTS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
#: Faults that say the server (or the route to it) is gone, not just this command:
#: they open the breaker.
CONNECTION_FAULTS: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
    RedisClusterException, OSError)


class TierClosed(ConnectionError):
    """The tier is closed: no client any more (absorbed like any connection fault)."""


class Connection:
    def __init__(self, options: RedisOptions, faults: TierFaults) -> None:
        self.options = options
        self.faults = faults
        self._client: Client | None = None
        self._lock = threading.Lock()
        self.closed = False

    def client(self) -> Client:
        """The redis-py client, created on first use."""
        with self._lock:
            if self.closed:
                raise TierClosed("the redis tier is closed")
            if self._client is None:
                self._client = make_client(self.options)
            return self._client

    @property
    def usable(self) -> bool:
        """False when closed or while the breaker is open (asks, never probes)."""
        return not self.closed and not self.faults.breaker.is_open

    def main_key(self, key: CacheKey) -> str:
        return self.options.store_key(key)

    def pipeline(self) -> Pipeline:
        """A pipeline for one round trip; ``BreakerOpen`` while the breaker is open."""
        self.faults.check()
        return self.client().pipeline(transaction=False)

    def execute(self, pipe: Pipeline) -> list[Any]:
        """Send the pipeline; a command's own error (WRONGTYPE, OOM) comes back as
        its reply. A cluster pipeline also answers a node it could not reach with
        the connection error as a reply: that raises, as from one server, since
        nothing answered (a timeout is never "present" nor "corrupt")."""
        replies = pipe.execute(raise_on_error=False)
        lost = next((r for r in replies if isinstance(r, CONNECTION_FAULTS)), None)
        if lost is not None:
            raise lost
        self.faults.succeeded()
        return replies

    def call(self, fn: Callable[[Client], T]) -> T:
        """``fn(client)``: requests under the breaker (``INFO`` on every node, ...)."""
        self.faults.check()
        result = fn(self.client())
        self.faults.succeeded()
        return result

    def command(self, *args: Any) -> Any:
        """One command, one round trip, under the breaker."""
        return self.call(lambda client: client.execute_command(*args))

    def close(self) -> None:
        """Disconnect every socket, including those another thread is blocked on."""
        with self._lock:
            self.closed = True
            client, self._client = self._client, None
        if client is not None:
            _disconnect(client)


def _disconnect(client: Client) -> None:
    pools = []
    if hasattr(client, "get_nodes"):
        pools = [n.redis_connection.connection_pool for n in client.get_nodes()
                 if n.redis_connection is not None]
    else:
        pools = [client.connection_pool]
    for pool in pools:
        try:
            pool.disconnect()
        except Exception:  # a socket that fails to close is closed enough
            logger.debug("disconnecting a redis pool failed", exc_info=True)
