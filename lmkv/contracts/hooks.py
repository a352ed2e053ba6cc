"""Hook specifications: the whole contract between lmkv and its plugins.

Every hook takes no arguments and returns one plugin class or a list of them
(hatch style). The class carries its own ``name`` and ``Options`` model; the
registry records a duplicate or broken class as a failure of its plugin and
leaves it out. Built-in plugins use these very hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from lmkv.contracts.connector import GPUConnector
    from lmkv.contracts.policy import EvictionPolicy, OffloadPolicy
    from lmkv.contracts.serde import Serializer
    from lmkv.contracts.tier import StorageBackend

PROJECT = "lmkv"
ENTRY_POINT_GROUP = "lmkv"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def lmkv_storage_backends() -> type[StorageBackend] | list[type[StorageBackend]]:
    """Return storage backend classes (tiers), subclasses of ``lmkv.StorageBackend``."""


@hookspec
def lmkv_eviction_policies() -> type[EvictionPolicy] | list[type[EvictionPolicy]]:
    """Return eviction policy classes, subclasses of ``lmkv.EvictionPolicy``."""


@hookspec
def lmkv_offload_policies() -> type[OffloadPolicy] | list[type[OffloadPolicy]]:
    """Return lazy-offload policy classes, subclasses of ``lmkv.OffloadPolicy``."""


@hookspec
def lmkv_serializers() -> type[Serializer] | list[type[Serializer]]:
    """Return serializer classes, subclasses of ``lmkv.Serializer``."""


@hookspec
def lmkv_gpu_connectors() -> type[GPUConnector] | list[type[GPUConnector]]:
    """Return GPU connector classes, subclasses of ``lmkv.GPUConnector``."""
