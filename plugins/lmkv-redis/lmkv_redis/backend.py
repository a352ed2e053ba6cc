"""The ``redis`` tier: lmkv frames in a Redis server or a Redis Cluster.

Every batch is one pipeline: a lookup of 128 keys is one round trip, a get
fetches every part of every entry in one round trip (when the entries were
pinned by the lookup that preceded it, which records their part counts), and
a put writes all its entries in one (per ``pipeline_bytes`` of values).

Pins are local: this process counts them so it knows what it is about to
read. Redis itself evicts by its own ``maxmemory-policy``; a pinned entry the
server evicted is simply a miss when it is read.

Faults follow lmkv's one policy (``lmkv.contracts.faults``): a Redis or network error
is a counted, rate-logged miss or dropped write; a lost connection or a
timeout opens the tier's breaker for ``retry_after_s`` (a hung server would
otherwise cost every engine step a full timeout), then one request probes;
redis-py's pool reconnects on that request. The reader, the writer and the
server figures share a ``Connection``, never the backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from lmkv.contracts import (
    BackendContext,
    CacheKey,
    MemoryObj,
    OptionsArg,
    PinTable,
    PrefixGets,
    StorageBackend,
    read_windows,
    remote_faults,
    secrets_in,
)
from lmkv_redis.connection import CONNECTION_FAULTS, FAULTS, Connection
from lmkv_redis.options import RedisOptions, redact_url
from lmkv_redis.reader import Fetched, Reader
from lmkv_redis.server_info import ServerInfo
from lmkv_redis.writer import Writer

logger = logging.getLogger(__name__)

#: Gets of concurrent lookups run side by side, each on its own connection.
GET_THREADS = 4
#: Empty-value checks start at most this often (lookups that miss are frequent).
SWEEP_INTERVAL_S = 0.05


class RedisBackend(StorageBackend):
    name = "redis"
    api_version = "2.0"
    Options = RedisOptions

    options: RedisOptions

    def __init__(self, options: OptionsArg = None, context: BackendContext | None = None) -> None:
        super().__init__(options, context)
        options, context = self.options, self.context
        if context.serializer is None:
            raise ValueError("the redis tier needs a serializer")
        self.where = redact_url(options.url)
        self.faults = remote_faults(
            self.counters, f"redis tier ({self.where})", options, absorbed=FAULTS,
            unreachable=CONNECTION_FAULTS, secrets=[options.password, *secrets_in(options.url)],
            log=logger)
        self.connection = Connection(options, self.faults)
        # Each pin records the part count its lookup saw: the get fetches every part
        # in one round trip.
        self._pins: PinTable[int] = PinTable()
        self._close_lock = threading.Lock()
        self._closing = False
        self._writer = Writer(self.connection, context.serializer)
        self._reader = Reader(self.connection)
        self._info = ServerInfo(self.connection)
        self._gets = PrefixGets(self.faults, GET_THREADS, "lmkv-redis-get")
        self._sweeping = threading.Lock()  # held while an empty-value check runs
        self._last_sweep = 0.0

    def __repr__(self) -> str:
        return f"RedisBackend({self.where}, cluster={self.options.cluster})"

    def _part_hint(self, name: str) -> int:
        return self._pins.seen(name, 1)

    # -- lookups ------------------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return self.batched_async_contains("", [key], pin=pin) == 1

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        if not keys:
            return 0
        names = [self.connection.main_key(k) for k in keys]
        parts: list[int] = []
        with self.faults.guard("lookup", "answering misses"):
            parts = self._reader.probe(names)
        hits = 0
        for count in parts:
            if count == 0:
                # GETRANGE answers "" for an absent key and for an empty value alike:
                # the lookup takes it as a miss now, and a check in the background
                # removes an empty value (a corrupt frame) without costing the lookup.
                self.sweep_empty(names[hits])
                break
            hits += 1
        if pin and hits:
            self._pins.pin(names[:hits], parts[:hits])
        return hits

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        """Release one pin of this process; False when it held none on ``key``."""
        return self._pins.unpin(self.connection.main_key(key))

    def sweep_empty(self, name: str) -> None:
        """Check ``name`` for an empty value in the background; at most one check
        runs at a time (a lookup never waits on it, and misses cost Redis one
        check at a time, not one per lookup)."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_INTERVAL_S or not self._sweeping.acquire(
                blocking=False):
            return
        self._last_sweep = now
        if self._gets.run(self._sweep, name) is None:  # closed
            self._sweeping.release()

    def _sweep(self, name: str) -> None:
        try:
            with self.faults.guard("check", "an empty value, if any, stays for now"):
                if self.connection.usable and self._reader.drop_if_empty(name):
                    self.faults.corrupt(name, "an empty value")
        except Exception:  # a bug, on a background thread: say so, never lose the lock
            logger.exception("lmkv redis tier: checking %s for an empty value failed", name)
        finally:
            self._sweeping.release()

    # -- gets -----------------------------------------------------------------------
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        objs = self._gets.read_prefix([key], self._read)
        return objs[0] if objs else None

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        return self._gets.submit(keys, self._read)

    def _read(self, keys: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        """The leading entries found, into ``out``: windows of ``pipeline_bytes``
        (every key at once until a frame was seen), each one pipeline; a window
        that ends short (an absent entry) or at a bad entry is the last."""
        def size() -> int:
            frame = self._reader.last_frame_len
            return max(1, self.options.pipeline_bytes // frame) if frame else len(keys)

        def take(window: Sequence[CacheKey], fetched: list[Fetched]) -> bool:
            return self._decode_window(fetched, out) and len(fetched) == len(window)

        read_windows(keys, size, lambda window: self._reader.fetch(window, self._part_hint),
                     take)

    def _decode_window(self, window: list[Fetched], out: list[MemoryObj]) -> bool:
        """Decode the window's frames into ``out``; False at the first that is
        not a whole, valid frame (a lost part is a miss, the rest of the entry is
        deleted; a corrupt one is dropped by the fault policy)."""
        for entry in window:
            if entry.corrupt is not None:
                self.drop_corrupt(entry.key, entry.corrupt)
                return False
            if entry.lost_part:
                self.faults.note("missing-part", "entry %s lost a part (expired or evicted);"
                                 " a miss, deleting the rest", entry.name)
                self.remove(entry.key)
                return False
            obj = self.decode_frame(entry.key, entry.frame)
            if obj is None:
                return False
            self.counters.bytes_out += entry.frame_len
            out.append(obj)
        return True

    # -- puts -----------------------------------------------------------------------
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        # Redis evicts by its own maxmemory-policy: parents are not used here.
        return self._writer.submit(list(keys), list(objs))

    # -- removal --------------------------------------------------------------------
    def remove(self, key: CacheKey) -> bool:
        """Delete ``key`` and its parts from Redis, pinned or not (pins are local)."""
        size = None
        with self.faults.guard("remove", "entry left in place"):
            size = self._reader.delete(self.connection.main_key(key))
        if size is None:
            return False
        self._writer.forget(size)
        return True

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
        return {**super().stats(), "pinned_keys": len(self._pins),
                "pending_put_bytes": self._writer.pending_bytes,
                "server_used_memory": self._info.used_memory()}

    def close(self) -> None:
        """Wait up to ``close_timeout_s`` for puts in flight, then drop the rest and
        disconnect; returns promptly even when the server is gone or hung."""
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self._writer.close(self.options.close_timeout_s)  # puts in flight may still finish
        self.faults.close()  # from here on, what the pulled sockets raise is absorbed
        self._gets.close()
        self.connection.close()
        self._pins.clear()
        super().close()

