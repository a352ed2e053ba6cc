"""The storage manager: an ordered list of tiers behind one store/lookup/get API.

Stores go to every tier (each tier's put is asynchronous by contract); lookups
and gets are strict prefixes across tiers: tier 1 serves chunks 0..k1, tier 2
serves k1..k2, and so on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from lmkv.backend import BackendContext, StorageBackend
from lmkv.config import LMKVConfig, resolve_plugin
from lmkv.logutil import RateLimitedLog
from lmkv.memory import MemoryObj, tensor_obj
from lmkv.tokens import CacheKey

logger = logging.getLogger(__name__)
_put_log = RateLimitedLog(logger)


class StorageManager:
    def __init__(self, tiers: Sequence[StorageBackend]) -> None:
        if not tiers:
            raise ValueError("the storage manager needs at least one tier")
        self.tiers = list(tiers)
        self.failed_puts = 0

    @classmethod
    def from_config(cls, config: LMKVConfig, plugin_manager: Any = None) -> StorageManager:
        serializer_cls, serializer_opts = resolve_plugin(
            "serializer", config.serializer, "serializer", plugin_manager)
        tiers: list[StorageBackend] = []
        for i, tier in enumerate(config.tiers):
            backend_cls, options = resolve_plugin(
                "storage_backend", tier, f"tiers.{i}", plugin_manager)
            policy_cls, policy_opts = resolve_plugin(
                "eviction_policy", tier.eviction, f"tiers.{i}.eviction", plugin_manager)
            context = BackendContext(
                serializer=serializer_cls(serializer_opts),
                eviction_policy=policy_cls(policy_opts),
                allocate=lambda shape, dtype: allocate_from(tiers, shape, dtype),
                tier_index=i,
            )
            tiers.append(backend_cls(options, context))
        return cls(tiers)

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        return allocate_from(self.tiers, shape, dtype)

    def put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> Future:
        """Store ``objs`` in every tier, asynchronously; returns the first tier's future.

        Tiers take their own references, so the caller may release its own at
        once. A tier that fails is logged and counted, never raised to the caller.
        """
        futures = []
        for tier in self.tiers:
            try:
                future = tier.batched_submit_put(keys, objs)
            except Exception as exc:
                future = Future()
                future.set_exception(exc)
            future.add_done_callback(partial(self._put_done, tier))
            futures.append(future)
        return futures[0]

    def _put_done(self, tier: StorageBackend, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            self.failed_puts += 1
            _put_log.warning(f"put:{tier.name}", "lmkv %s tier: put failed: %s", tier.name, exc)

    def contains_prefix(self, keys: Sequence[CacheKey]) -> int:
        """How many leading keys some tier holds, as a strict prefix across tiers."""
        hits = 0
        for tier in self.tiers:
            if hits == len(keys):
                break
            hits += tier.batched_async_contains("", keys[hits:])
        return hits

    def get(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        """The leading chunks found, each with a reference owned by the caller."""
        found: list[MemoryObj] = []
        for tier in self.tiers:
            if len(found) == len(keys):
                break
            found.extend(tier.batched_get_non_blocking("", keys[len(found):]).result())
        return found

    def stats(self) -> list[dict[str, Any]]:
        return [{"tier": i, "type": t.name, **t.stats()} for i, t in enumerate(self.tiers)]

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("closing tier %s failed", tier.name)


def allocate_from(tiers: Sequence[StorageBackend], shape: Sequence[int],
                  dtype: torch.dtype) -> MemoryObj | None:
    """A chunk buffer from the first tier that holds memory (evicting as needed);
    a plain tensor when no tier does (nothing then keeps it past the call)."""
    for tier in tiers:
        if tier.holds_memory_objs:
            return tier.allocate(shape, dtype)
    return tensor_obj(torch.empty(tuple(shape), dtype=dtype))
