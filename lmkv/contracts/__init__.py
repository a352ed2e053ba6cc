"""The contracts: everything a plugin author imports, from one place.

A plugin package (a tier, an eviction or offload policy, a serializer, a GPU
connector) imports lmkv's names from here and its tests from
``lmkv.testing``; nothing else of lmkv is a promise to other people's code.
Publish the plugin under the ``lmkv`` entry-point group::

    # pyproject.toml of "lmkv-hello"
    [project]
    dependencies = ["lmkv>=0.2,<0.3"]
    [project.entry-points.lmkv]
    lmkv-hello = "lmkv_hello.plugin"

    # lmkv_hello/plugin.py
    from lmkv.contracts import hookimpl
    from lmkv_hello.backend import HelloBackend

    @hookimpl
    def lmkv_storage_backends():
        return [HelloBackend]

    # lmkv_hello/backend.py
    from lmkv.contracts import StorageBackend

    class HelloBackend(StorageBackend):
        name = "hello"
        api_version = "2.0"      # the contract this class was written for
        ...

Each kind's contract has a version, ``API_VERSIONS[kind]`` (major.minor): a
class declares the one it was written for in ``api_version``. At load, lmkv
leaves out, with one line, a class written for another major version, and one
that does not fit its contract (an abstract method left, a constructor or a
method lmkv cannot call the way it calls it); docs/migrating-plugins.md says
what changed between versions.

A remote tier (its storage a server or a pool) builds on ``RemoteTierOptions``
and ``remote_faults`` (the options and fault policy every remote tier shares),
``PinTable`` (its local pins), ``PrefixGets`` and ``read_windows`` (a get of a
prompt's leading chunks, window by window) and ``PutQueue`` (bounded
asynchronous puts).

Every kind is built the same way,
``cls(options, context)``: its validated ``Options`` and a frozen dataclass of
what lmkv hands that kind (``BackendContext``, ``EvictionContext``,
``OffloadContext``, ``SerializerContext``, ``ConnectorContext``).

The names are imported on first use: ``import lmkv.contracts`` is cheap, and
only what a plugin uses pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkv.base.exports import lazy_exports

_LAZY: dict[str, str] = {
    # contract versions and the hooks
    "API_VERSIONS": "lmkv.contracts.versions",
    "ENTRY_POINT_GROUP": "lmkv.contracts.hooks",
    "hookimpl": "lmkv.contracts.hooks",
    "hookspec": "lmkv.contracts.hooks",
    # every plugin
    "NoOptions": "lmkv.contracts.plugin",
    "OptionsArg": "lmkv.contracts.plugin",
    "Plugin": "lmkv.contracts.plugin",
    "PluginOptions": "lmkv.contracts.plugin",
    # errors
    "ConfigError": "lmkv.base.errors",
    "CorruptFrameError": "lmkv.base.errors",
    "LMKVError": "lmkv.base.errors",
    "PluginError": "lmkv.base.errors",
    # keys
    "CacheKey": "lmkv.keys.chunking",
    "KeyMeta": "lmkv.keys.chunking",
    # memory
    "Allocate": "lmkv.memory",
    "MemoryAllocator": "lmkv.memory",
    "MemoryObj": "lmkv.memory",
    "release": "lmkv.memory",
    "tensor_obj": "lmkv.memory",
    # tiers
    "ArenaPlacement": "lmkv.contracts.tier",
    "BackendContext": "lmkv.contracts.tier",
    "StorageBackend": "lmkv.contracts.tier",
    "done_future": "lmkv.contracts.tier",
    "DirectChunk": "lmkv.contracts.direct_chunk",
    "MappedFile": "lmkv.contracts.mapped_file",
    # the fault policy tiers share
    "Breaker": "lmkv.contracts.faults",
    "BreakerOpen": "lmkv.contracts.faults",
    "TierCounters": "lmkv.contracts.faults",
    "TierFaults": "lmkv.contracts.faults",
    "TierUnavailable": "lmkv.contracts.faults",
    # helpers a remote tier needs
    "PinTable": "lmkv.contracts.pins",
    "PrefixGets": "lmkv.contracts.prefix_gets",
    "PutQueue": "lmkv.contracts.put_queue",
    "RemoteTierOptions": "lmkv.contracts.remote",
    "read_windows": "lmkv.contracts.prefix_gets",
    "remote_faults": "lmkv.contracts.remote",
    "ByteCount": "lmkv.base.units",
    "Redactor": "lmkv.base.redact",
    "redact_url": "lmkv.base.redact",
    "secrets_in": "lmkv.base.redact",
    "apply_affinity": "lmkv.base.affinity:apply",
    # serializers and frames
    "FrameHeader": "lmkv.contracts.serde",
    "Serializer": "lmkv.contracts.serde",
    "SerializerContext": "lmkv.contracts.serde",
    "header_len": "lmkv.contracts.serde",
    "read_header": "lmkv.contracts.serde",
    "verify_payload": "lmkv.contracts.serde",
    "write_header": "lmkv.contracts.serde",
    # policies
    "EvictionContext": "lmkv.contracts.policy",
    "EvictionPolicy": "lmkv.contracts.policy",
    "Lineage": "lmkv.contracts.policy",
    "SlotLineage": "lmkv.contracts.policy",
    "OffloadContext": "lmkv.contracts.policy",
    "OffloadItem": "lmkv.contracts.policy",
    "OffloadPolicy": "lmkv.contracts.policy",
    "StoreMeta": "lmkv.contracts.policy",
    # GPU connectors
    "ChunkSpan": "lmkv.contracts.connector",
    "ConnectorContext": "lmkv.contracts.connector",
    "GPUConnector": "lmkv.contracts.connector",
    "KVSpec": "lmkv.contracts.connector",
}

if TYPE_CHECKING:
    from lmkv.base.affinity import apply as apply_affinity
    from lmkv.base.errors import ConfigError, CorruptFrameError, LMKVError, PluginError
    from lmkv.base.redact import Redactor, redact_url, secrets_in
    from lmkv.base.units import ByteCount
    from lmkv.contracts.connector import ChunkSpan, ConnectorContext, GPUConnector, KVSpec
    from lmkv.contracts.direct_chunk import DirectChunk
    from lmkv.contracts.faults import (
        Breaker,
        BreakerOpen,
        TierCounters,
        TierFaults,
        TierUnavailable,
    )
    from lmkv.contracts.hooks import ENTRY_POINT_GROUP, hookimpl, hookspec
    from lmkv.contracts.mapped_file import MappedFile
    from lmkv.contracts.pins import PinTable
    from lmkv.contracts.plugin import NoOptions, OptionsArg, Plugin, PluginOptions
    from lmkv.contracts.policy import (
        EvictionContext,
        EvictionPolicy,
        Lineage,
        OffloadContext,
        OffloadItem,
        OffloadPolicy,
        SlotLineage,
        StoreMeta,
    )
    from lmkv.contracts.prefix_gets import PrefixGets, read_windows
    from lmkv.contracts.put_queue import PutQueue
    from lmkv.contracts.remote import RemoteTierOptions, remote_faults
    from lmkv.contracts.serde import (
        FrameHeader,
        Serializer,
        SerializerContext,
        header_len,
        read_header,
        verify_payload,
        write_header,
    )
    from lmkv.contracts.tier import ArenaPlacement, BackendContext, StorageBackend, done_future
    from lmkv.contracts.versions import API_VERSIONS
    from lmkv.keys.chunking import CacheKey, KeyMeta
    from lmkv.memory import Allocate, MemoryAllocator, MemoryObj, release, tensor_obj

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    "API_VERSIONS",
    "ENTRY_POINT_GROUP",
    "Allocate",
    "ArenaPlacement",
    "BackendContext",
    "Breaker",
    "BreakerOpen",
    "ByteCount",
    "CacheKey",
    "ChunkSpan",
    "ConfigError",
    "ConnectorContext",
    "CorruptFrameError",
    "DirectChunk",
    "EvictionContext",
    "EvictionPolicy",
    "FrameHeader",
    "GPUConnector",
    "KVSpec",
    "KeyMeta",
    "LMKVError",
    "Lineage",
    "MappedFile",
    "MemoryAllocator",
    "MemoryObj",
    "NoOptions",
    "OffloadContext",
    "OffloadItem",
    "OffloadPolicy",
    "OptionsArg",
    "PinTable",
    "Plugin",
    "PluginError",
    "PluginOptions",
    "PrefixGets",
    "PutQueue",
    "Redactor",
    "RemoteTierOptions",
    "Serializer",
    "SerializerContext",
    "SlotLineage",
    "StorageBackend",
    "StoreMeta",
    "TierCounters",
    "TierFaults",
    "TierUnavailable",
    "apply_affinity",
    "done_future",
    "header_len",
    "hookimpl",
    "hookspec",
    "read_header",
    "read_windows",
    "redact_url",
    "release",
    "remote_faults",
    "secrets_in",
    "tensor_obj",
    "verify_payload",
    "write_header",
]
