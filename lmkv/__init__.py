"""lmkv: a tiered, pluggable KV-cache layer for LLM serving engines."""

from lmkv.backend import BackendContext, StorageBackend
from lmkv.config import LMKVConfig, load_config
from lmkv.engine import CacheEngine, RetrieveResult
from lmkv.errors import (
    ConfigError,
    CorruptFrameError,
    DuplicatePluginError,
    LMKVError,
    PluginError,
    UnknownPluginError,
)
from lmkv.gpu import ChunkSpan, GPUConnector, KVSpec
from lmkv.memory import MemoryAllocator, MemoryObj
from lmkv.plugins import NoOptions, PluginOptions, hookimpl
from lmkv.policy import EvictionPolicy, OffloadItem, OffloadPolicy
from lmkv.serde import Serializer
from lmkv.storage import StorageManager
from lmkv.tokens import CacheKey, KeyMeta, TokenChunker, prefix_hashes

__version__ = "0.1.0"

__all__ = [
    "BackendContext",
    "CacheEngine",
    "CacheKey",
    "ChunkSpan",
    "ConfigError",
    "CorruptFrameError",
    "DuplicatePluginError",
    "EvictionPolicy",
    "GPUConnector",
    "KVSpec",
    "KeyMeta",
    "LMKVConfig",
    "LMKVError",
    "MemoryAllocator",
    "MemoryObj",
    "NoOptions",
    "OffloadItem",
    "OffloadPolicy",
    "PluginError",
    "PluginOptions",
    "RetrieveResult",
    "Serializer",
    "StorageBackend",
    "StorageManager",
    "TokenChunker",
    "UnknownPluginError",
    "__version__",
    "hookimpl",
    "load_config",
    "prefix_hashes",
]
