"""What every remote tier's options and fault policy share.

A remote tier (its storage is a server or a pool other processes reach too:
Redis, Mooncake) namespaces its keys, writes asynchronously through a bounded
``PutQueue``, and must never let a storage that is down or hung hold an
engine: after a connection fails it answers misses for a while without
asking (its breaker), then probes. ``RemoteTierOptions`` carries the options
for that, under the same names and meanings in every such tier; a tier's
``Options`` subclasses it and adds its own (a field declared again keeps its
name and takes the subclass's default or bounds). ``remote_faults`` builds
the tier's ``TierFaults`` from them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pydantic import ByteSize, ConfigDict, Field

from lmkv.base.redact import Redactor
from lmkv.base.units import ByteCount
from lmkv.contracts.faults import Breaker, TierCounters, TierFaults
from lmkv.contracts.plugin import PluginOptions
from lmkv.keys.chunking import CacheKey


class RemoteTierOptions(PluginOptions):
    """The options every remote tier has (``tiers.N.options``)."""

    # A timeout, TTL or retry delay of inf (or nan) never ends: only finite numbers.
    model_config = ConfigDict(allow_inf_nan=False)

    key_prefix: str = "lmkv:"
    """Namespace: every key this tier writes starts with it."""
    retry_after_s: float = Field(default=1.0, ge=0)
    """After a connection failure, answer misses without touching the network for
    this long, then try again."""
    close_timeout_s: float = Field(default=2.0, ge=0)
    """``close()`` waits this long for puts in flight, then drops them."""
    max_pending_bytes: ByteCount = Field(default=ByteSize(1 << 30), ge=0)
    """Bytes of submitted puts not yet written; past it new puts are dropped and
    counted (a slow storage must not hold the cpu tier's buffers forever)."""

    def store_key(self, key: CacheKey) -> str:
        """The name an entry is stored under: ``key_prefix`` and the key's string."""
        return self.key_prefix + key.to_string()


def remote_faults(counters: TierCounters, where: str, options: RemoteTierOptions, *,
                  absorbed: tuple[type[BaseException], ...],
                  unreachable: tuple[type[BaseException], ...],
                  longest_backoff_s: float | None = None, secrets: Iterable[object] = (),
                  log: logging.Logger | None = None) -> TierFaults:
    """A remote tier's fault policy. ``where`` names the tier in every line
    ("redis tier (redis://cache:6379/0)"); ``absorbed``: what its client library
    raises at run time (a counted miss or dropped write); ``unreachable``: what
    says the storage is gone (the breaker opens for ``options.retry_after_s``,
    growing to ``longest_backoff_s`` while it stays down, by default the same);
    ``secrets`` (passwords, credentials found in URLs: ``secrets_in``) are masked
    in every line; ``log``: the tier's logger, so its name filters."""
    first = options.retry_after_s
    return TierFaults(counters, where, absorbed=absorbed, unreachable=unreachable,
                      breaker=Breaker(first, first if longest_backoff_s is None
                                      else longest_backoff_s),
                      redact=Redactor(secrets), log=log)
