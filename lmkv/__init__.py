"""lmkv: a tiered, pluggable KV-cache layer for LLM serving engines.

The public names below are imported on first use (a module ``__getattr__``),
so ``import lmkv`` and the ``lmkv`` command stay fast: most of them pull in
torch, which a command such as ``lmkv --help`` never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkv.base import moved
from lmkv.base.errors import (
    ConfigError,
    CorruptFrameError,
    DuplicatePluginError,
    LMKVError,
    PluginError,
    UnknownPluginError,
)
from lmkv.base.exports import lazy_exports

__version__ = "0.2.0"

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "ArenaPlacement": "lmkv.contracts.tier",
    "BackendContext": "lmkv.contracts.tier",
    "StorageBackend": "lmkv.contracts.tier",
    "LMKVConfig": "lmkv.config",
    "load_config": "lmkv.config",
    "Engine": "lmkv.engines.protocol",
    "RetrieveResult": "lmkv.engines.protocol",
    "open_engine": "lmkv.engines.open",
    "ChunkSpan": "lmkv.contracts.connector",
    "ConnectorContext": "lmkv.contracts.connector",
    "GPUConnector": "lmkv.contracts.connector",
    "KVSpec": "lmkv.contracts.connector",
    "MemoryAllocator": "lmkv.memory",
    "MemoryObj": "lmkv.memory",
    "NoOptions": "lmkv.contracts.plugin",
    "PluginOptions": "lmkv.contracts.plugin",
    "hookimpl": "lmkv.contracts.hooks",
    "EvictionContext": "lmkv.contracts.policy",
    "EvictionPolicy": "lmkv.contracts.policy",
    "OffloadContext": "lmkv.contracts.policy",
    "OffloadItem": "lmkv.contracts.policy",
    "OffloadPolicy": "lmkv.contracts.policy",
    "Serializer": "lmkv.contracts.serde",
    "SerializerContext": "lmkv.contracts.serde",
    "StorageManager": "lmkv.storage",
    "CacheKey": "lmkv.keys.chunking",
    "KeyMeta": "lmkv.keys.chunking",
    "TokenChunker": "lmkv.keys.chunking",
    "prefix_hashes": "lmkv.keys.chunking",
}

if TYPE_CHECKING:
    from lmkv.config.model import LMKVConfig, load_config
    from lmkv.contracts.connector import ChunkSpan, ConnectorContext, GPUConnector, KVSpec
    from lmkv.contracts.hooks import hookimpl
    from lmkv.contracts.plugin import NoOptions, PluginOptions
    from lmkv.contracts.policy import (
        EvictionContext,
        EvictionPolicy,
        OffloadContext,
        OffloadItem,
        OffloadPolicy,
    )
    from lmkv.contracts.serde import Serializer, SerializerContext
    from lmkv.contracts.tier import ArenaPlacement, BackendContext, StorageBackend
    from lmkv.engines.open import open_engine
    from lmkv.engines.protocol import Engine, RetrieveResult
    from lmkv.keys.chunking import CacheKey, KeyMeta, TokenChunker, prefix_hashes
    from lmkv.memory import MemoryAllocator, MemoryObj
    from lmkv.storage.manager import StorageManager


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
moved.install()  # lmkv 0.1's module paths (lmkv.backend, ...) for one more release


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
