"""Tiers, serializers and configs for a plugin's tests, built the way lmkv builds
them: plugins found by name through the installed entry points, options
validated, so a test needs nothing of lmkv beyond ``lmkv.contracts`` and
``lmkv.testing``.

* ``serializer("naive")``: a serializer by its registered name.
* ``open_tier("redis", {"url": ...})``: a tier by name with its options, a
  serializer and an arena of its own (closed by the caller).
* ``load_test_config({...})``: ``lmkv.*`` overrides as a loaded config, the
  environment left out (a ``ConfigError`` says what is wrong, as at start).
* ``strict_refcounts()``: a double release raises instead of being logged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lmkv.config.model import LMKVConfig, load_config
from lmkv.contracts.policy import EvictionContext
from lmkv.contracts.serde import Serializer, SerializerContext
from lmkv.contracts.tier import BackendContext, StorageBackend
from lmkv.memory import MemoryAllocator
from lmkv.plugins.manager import get_plugin_manager


def serializer(name: str = "naive", options: Mapping[str, Any] | None = None) -> Serializer:
    """The serializer registered as ``name`` (``naive``, ``zstd``, ``int8``, a plugin's)."""
    cls = get_plugin_manager().serializer(name)
    return cls(options or {}, SerializerContext())


def open_tier(name: str, options: Mapping[str, Any] | None = None, *,
              serializer_name: str = "naive", arena_bytes: int = 64 << 20,
              tier_index: int = 0) -> StorageBackend:
    """The tier registered as ``name`` with ``options``, built as a config's tier is
    (options validated, its default eviction policy, a ``serializer_name``
    serializer) with an arena of ``arena_bytes`` of its own for what it reads. A
    bad option is the ``ConfigError`` lmkv says at start. The caller closes it."""
    config = load_test_config({"lmkv.serializer": serializer_name,
                               "lmkv.tiers": [{"type": name, "options": dict(options or {})}]})
    plugins = config.plugins
    (tier,) = plugins.tiers
    arena = MemoryAllocator(arena_bytes, pin_memory=False)  # (its allocate keeps it alive)
    return tier.backend.create(BackendContext(
        serializer=plugins.serializer.create(SerializerContext()),
        eviction_policy=tier.eviction.create(EvictionContext(tier_index=tier_index)),
        allocate=arena.allocate, tier_index=tier_index))


def load_test_config(overrides: Mapping[str, Any], env: Mapping[str, str] | None = None
                     ) -> LMKVConfig:
    """``overrides`` (``{"lmkv.tiers": [...], "lmkv.chunk_size": 32}``) as a loaded
    config; ``env`` (default: none) stands for the process's ``LMKV_*`` variables."""
    return load_config(env=dict(env or {}), overrides=dict(overrides))


@contextmanager
def strict_refcounts() -> Iterator[None]:
    """Inside the block, releasing a MemoryObj more often than it was taken
    raises (a bug in a tier) instead of being logged."""
    import lmkv.memory

    previous = lmkv.memory.strict_refcounts
    lmkv.memory.strict_refcounts = True
    try:
        yield
    finally:
        lmkv.memory.strict_refcounts = previous
