"""What a config's plugin references resolve to: typed classes and validated options.

``lmkv.config.load_config`` resolves every plugin a config names in one step
and keeps the result on the config (``LMKVConfig.plugins``); the storage
manager, the engines, the server and the vLLM integration build their plugins
from it and never look a plugin up by name again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lmkv.plugin_base import PluginOptions

if TYPE_CHECKING:
    from lmkv.backend import StorageBackend
    from lmkv.gpu import GPUConnector
    from lmkv.policy import EvictionPolicy, OffloadPolicy
    from lmkv.serde import Serializer

P = TypeVar("P")


@dataclass(frozen=True)
class Resolved(Generic[P]):
    """One plugin a config selects: its class and its options, already validated."""

    cls: type[P]
    options: PluginOptions

    def create(self, context: Any) -> P:
        """The plugin, built the one way every kind is built: ``cls(options, context)``."""
        return self.cls(self.options, context)  # type: ignore[call-arg]


@dataclass(frozen=True)
class ResolvedTier:
    """One storage tier: its backend and that tier's eviction policy."""

    backend: Resolved[StorageBackend]
    eviction: Resolved[EvictionPolicy]


@dataclass(frozen=True)
class ResolvedPlugins:
    """Every plugin a config selects (``gpu_connector`` is None when the config leaves
    the choice to the integration: ``hf`` for transformers, ``paged`` for vLLM)."""

    tiers: tuple[ResolvedTier, ...]
    serializer: Resolved[Serializer]
    offload_policy: Resolved[OffloadPolicy]
    gpu_connector: Resolved[GPUConnector] | None = None
