"""The ``redis`` tier: lmkv frames in a Redis server or a Redis Cluster.

Every batch is one pipeline: a lookup of 128 keys is one round trip, a get
fetches every part of every entry in one round trip (when the entries were
pinned by the lookup that preceded it, which records their part counts), and
a put writes all its entries in one (per ``pipeline_bytes`` of values).

Pins are local: this process counts them so it knows what it is about to
read. Redis itself evicts by its own ``maxmemory-policy``; a pinned entry the
server evicted is simply a miss when it is read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from lmkv.backend import BackendContext, StorageBackend, done_future
from lmkv.memory import MemoryObj
from lmkv.redact import Redactor, secrets_in
from lmkv.tokens import CacheKey
from lmkv_redis.connect import Client, make_client
from lmkv_redis.faults import Faults
from lmkv_redis.options import RedisOptions, redact_url
from lmkv_redis.reader import Reader
from lmkv_redis.server_info import ServerInfo
from lmkv_redis.writer import Writer

logger = logging.getLogger(__name__)

#: Gets of concurrent lookups run side by side, each on its own connection.
GET_THREADS = 4
#: Empty-value checks start at most this often (lookups that miss are frequent).
SWEEP_INTERVAL_S = 0.05


@dataclass
class _Pin:
    count: int
    parts: int  # part count seen by the lookup: lets the get fetch all parts at once


class RedisBackend(StorageBackend):
    name = "redis"
    Options = RedisOptions

    def __init__(self, options: RedisOptions, context: BackendContext) -> None:
        super().__init__(options, context)
        if context.serializer is None:
            raise ValueError("the redis tier needs a serializer")
        self.options: RedisOptions = options
        self.where = redact_url(options.url)
        self.faults = Faults(self.counters, self.where, options.retry_after_s,
                             Redactor([options.password, *secrets_in(options.url)]))
        self._client_obj: Client | None = None
        self._client_lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}
        self._pins_lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._writer = Writer(self)
        self._reader = Reader(self)
        self._info = ServerInfo(self)
        self._gets = ThreadPoolExecutor(max_workers=GET_THREADS,
                                        thread_name_prefix="lmkv-redis-get")
        self._sweeping = threading.Lock()  # held while an empty-value check runs
        self._last_sweep = 0.0

    def __repr__(self) -> str:
        return f"RedisBackend({self.where}, cluster={self.options.cluster})"

    # -- plumbing shared by the reader and the writer --------------------------
    def client(self) -> Client:
        """The redis-py client, created on first use (a cluster client connects then)."""
        with self._client_lock:
            if self._closed:
                raise _ClosedError("the redis tier is closed")
            if self._client_obj is None:
                self._client_obj = make_client(self.options)
            return self._client_obj

    @property
    def usable(self) -> bool:
        """False when closed or backing off after a connection fault."""
        return not self._closed and not self.faults.down

    def main_key(self, key: CacheKey) -> str:
        return self.options.key_prefix + key.to_string()

    def part_hint(self, name: str) -> int:
        pin = self._pins.get(name)
        return pin.parts if pin is not None else 1

    # -- lookups ------------------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return self.batched_async_contains("", [key], pin=pin) == 1

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        if not keys or not self.usable:
            return 0
        names = [self.main_key(k) for k in keys]
        try:
            parts = self._reader.probe(names)
        except Exception as exc:
            if not self.faults.expected(exc):
                raise
            self.faults.record("lookup", exc, "answering misses")
            return 0
        hits = 0
        for count in parts:
            if count == 0:
                break
            hits += 1
        if pin and hits:
            with self._pins_lock:
                for name, count in zip(names[:hits], parts[:hits], strict=True):
                    entry = self._pins.get(name)
                    if entry is None:
                        self._pins[name] = _Pin(1, count)
                    else:
                        entry.count += 1
                        entry.parts = count
        return hits

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        """Release one pin of this process; False when it held none on ``key``."""
        name = self.main_key(key)
        with self._pins_lock:
            entry = self._pins.get(name)
            if entry is None:
                return False
            entry.count -= 1
            if entry.count == 0:
                del self._pins[name]
            return True

    def sweep_empty(self, name: str) -> None:
        """Check ``name`` for an empty value in the background; at most one check
        runs at a time (a lookup never waits on it, and misses cost Redis one
        check at a time, not one per lookup)."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_INTERVAL_S or not self._sweeping.acquire(
                blocking=False):
            return
        self._last_sweep = now
        try:
            self._gets.submit(self._sweep, name)
        except RuntimeError:  # closed
            self._sweeping.release()

    def _sweep(self, name: str) -> None:
        try:
            if self.usable:
                self._reader.drop_if_empty(name)
        except Exception as exc:
            if not self.faults.expected(exc):
                logger.exception("lmkv redis tier: checking %s for an empty value failed",
                                 name)
            else:
                self.faults.record("check", exc, "an empty value, if any, stays for now")
        finally:
            self._sweeping.release()

    # -- gets -----------------------------------------------------------------------
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        objs = self._get_prefix([key])
        return objs[0] if objs else None

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        if not keys:
            return done_future([])
        try:
            return self._gets.submit(self._get_prefix, list(keys))
        except RuntimeError:  # closed
            return done_future([])

    def _get_prefix(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        if not self.usable:
            self.counters.misses += 1
            return []
        try:
            objs = self._reader.get_prefix(keys)
        except Exception as exc:
            if not self.faults.expected(exc):
                raise
            self.faults.record("get", exc, "answering misses")
            objs = []
        self.counters.hits += len(objs)
        self.counters.misses += len(objs) < len(keys)
        return objs

    # -- puts -----------------------------------------------------------------------
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> Future:
        return self._writer.submit(list(keys), list(objs))

    # -- removal --------------------------------------------------------------------
    def remove(self, key: CacheKey) -> bool:
        """Delete ``key`` and its parts from Redis, pinned or not (pins are local)."""
        if not self.usable:
            return False
        try:
            return self._reader.delete(self.main_key(key))
        except Exception as exc:
            if not self.faults.expected(exc):
                raise
            self.faults.record("remove", exc, "entry left in place")
            return False

    # -- figures --------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """Frame bytes this process added to Redis (new entries it wrote, less entries
        it removed). Blind to TTL expiry, server eviction and other processes."""
        return max(0, self._writer.net_bytes)

    @property
    def capacity_bytes(self) -> int | None:
        """The server's ``maxmemory`` (summed over a cluster's primaries); None when
        unlimited or unknown."""
        return self._info.maxmemory()

    def stats(self) -> dict[str, int | None]:
        with self._pins_lock:
            pinned = len(self._pins)
        return {**super().stats(), "pinned_keys": pinned,
                "pending_put_bytes": self._writer.pending_bytes,
                "server_used_memory": self._info.used_memory()}

    def close(self) -> None:
        """Wait up to ``close_timeout_s`` for puts in flight, then drop the rest and
        disconnect; returns promptly even when the server is gone or hung."""
        with self._client_lock:
            if self._closing:
                return
            self._closing = True
        self._writer.close(self.options.close_timeout_s)  # puts in flight may still finish
        with self._client_lock:
            self._closed = True
            self.faults.closed = True
            client, self._client_obj = self._client_obj, None
        self._gets.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            _disconnect(client)
        with self._pins_lock:
            self._pins.clear()
        super().close()


class _ClosedError(ConnectionError):
    """Raised inside the tier after close(); caught like any connection fault."""


def _disconnect(client: Client) -> None:
    """Close every socket, including those another thread is blocked on."""
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
