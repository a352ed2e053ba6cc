"""Where a fleet's chunks are, kept in a Redis the fleet already runs.

Each instance registers the chunk keys it stores (its memory tier holds
them) under its own address: one Redis set per key, ``<prefix><key digest>``,
of the addresses that said they hold it, expiring ``ttl_s`` after the last
registration. A lookup asks for the sets of its keys in one round trip and
reads each key from a holder. Nothing here is trusted to be current: an
entry of an instance that evicted the chunk since, left or died is a miss
when the holder is asked (frames are bound to their keys and verified, as
everywhere), and expires by itself; an address is taken only if it is one
of the fleet's ``peers``.

Redis faults (down, slow, refused) are misses and dropped registrations,
counted by the tier; redis-py reconnects on the next call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lmkv.base.errors import ConfigError
from lmkv.base.redact import redact_url
from lmkv.keys.chunking import CacheKey

logger = logging.getLogger(__name__)


class RedisDirectory:
    def __init__(self, url: str, members: Sequence[str], *, ttl_s: float, timeout_s: float,
                 prefix: str = "lmkv:where:") -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("the peer tier's directory needs redis-py: pip install redis"
                              ) from None
        self.where = redact_url(url)
        self.members = tuple(dict.fromkeys(members))
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = prefix.encode()
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False, protocol=2)

    def _name(self, key: CacheKey) -> bytes:
        return self.prefix + key.digest().hex().encode()

    def holders(self, keys: Sequence[CacheKey]) -> list[list[str]]:
        """Per key, the fleet's addresses that registered it (in ``members``' order).
        Asks about the members only (``SMISMEMBER``): a set that someone grew with
        other names costs nothing to read. Raises what redis-py raises
        (``errors``)."""
        members = self.members
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.smismember(self._name(key), list(members))
        return [[m for m, held in zip(members, flags or (), strict=False) if held]
                for flags in pipe.execute()]

    def register(self, address: str, keys: Sequence[CacheKey]) -> None:
        """Say that ``address`` holds ``keys`` (for ``ttl_s`` from now)."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            name = self._name(key)
            pipe.sadd(name, address)
            pipe.pexpire(name, self.ttl_ms)
        pipe.execute()

    def unregister(self, address: str, keys: Sequence[CacheKey]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.srem(self._name(key), address)
        pipe.execute()

    def close(self) -> None:
        try:
            self._client.close()
        except Exception as exc:  # closing a client whose server is gone
            logger.debug("lmkv peer directory: close: %s", exc)

    def __repr__(self) -> str:
        return f"RedisDirectory({self.where})"

