"""lmkv: a tiered, pluggable KV-cache layer for LLM serving engines.

The public names below are imported on first use (a module ``__getattr__``),
so ``import lmkv`` and the ``lmkv`` command stay fast: most of them pull in
torch, which a command such as ``lmkv --help`` never needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lmkv.errors import (
    ConfigError,
    CorruptFrameError,
    DuplicatePluginError,
    LMKVError,
    PluginError,
    UnknownPluginError,
)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "ArenaPlacement": "lmkv.backend",
    "BackendContext": "lmkv.backend",
    "StorageBackend": "lmkv.backend",
    "LMKVConfig": "lmkv.config",
    "load_config": "lmkv.config",
    "Engine": "lmkv.engines.protocol",
    "RetrieveResult": "lmkv.engines.protocol",
    "open_engine": "lmkv.engines.open",
    "ChunkSpan": "lmkv.gpu",
    "ConnectorContext": "lmkv.gpu",
    "GPUConnector": "lmkv.gpu",
    "KVSpec": "lmkv.gpu",
    "MemoryAllocator": "lmkv.memory",
    "MemoryObj": "lmkv.memory",
    "NoOptions": "lmkv.plugin_base",
    "PluginOptions": "lmkv.plugin_base",
    "hookimpl": "lmkv.plugins",
    "EvictionContext": "lmkv.policy",
    "EvictionPolicy": "lmkv.policy",
    "OffloadContext": "lmkv.policy",
    "OffloadItem": "lmkv.policy",
    "OffloadPolicy": "lmkv.policy",
    "Serializer": "lmkv.serde",
    "SerializerContext": "lmkv.serde",
    "StorageManager": "lmkv.storage",
    "CacheKey": "lmkv.tokens",
    "KeyMeta": "lmkv.tokens",
    "TokenChunker": "lmkv.tokens",
    "prefix_hashes": "lmkv.tokens",
}

if TYPE_CHECKING:
    from lmkv.backend import ArenaPlacement, BackendContext, StorageBackend
    from lmkv.config import LMKVConfig, load_config
    from lmkv.engines.open import open_engine
    from lmkv.engines.protocol import Engine, RetrieveResult
    from lmkv.gpu import ChunkSpan, ConnectorContext, GPUConnector, KVSpec
    from lmkv.memory import MemoryAllocator, MemoryObj
    from lmkv.plugin_base import NoOptions, PluginOptions
    from lmkv.plugins import hookimpl
    from lmkv.policy import (
        EvictionContext,
        EvictionPolicy,
        OffloadContext,
        OffloadItem,
        OffloadPolicy,
    )
    from lmkv.serde import Serializer, SerializerContext
    from lmkv.storage import StorageManager
    from lmkv.tokens import CacheKey, KeyMeta, TokenChunker, prefix_hashes


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArenaPlacement",
    "BackendContext",
    "CacheKey",
    "ChunkSpan",
    "ConfigError",
    "ConnectorContext",
    "CorruptFrameError",
    "DuplicatePluginError",
    "Engine",
    "EvictionContext",
    "EvictionPolicy",
    "GPUConnector",
    "KVSpec",
    "KeyMeta",
    "LMKVConfig",
    "LMKVError",
    "MemoryAllocator",
    "MemoryObj",
    "NoOptions",
    "OffloadContext",
    "OffloadItem",
    "OffloadPolicy",
    "PluginError",
    "PluginOptions",
    "RetrieveResult",
    "Serializer",
    "SerializerContext",
    "StorageBackend",
    "StorageManager",
    "TokenChunker",
    "UnknownPluginError",
    "__version__",
    "hookimpl",
    "load_config",
    "open_engine",
    "prefix_hashes",
]
