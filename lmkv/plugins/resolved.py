"""What a config's plugin references resolve to: typed classes and validated options.

``lmkv.config.model.load_config`` resolves every plugin a config names in one step
and keeps the result on the config (``LMKVConfig.plugins``); the storage
manager, the engines, the server and the vLLM integration build their plugins
from it and never look a plugin up by name again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lmkv.base.errors import ConfigError, LMKVError, PluginError
from lmkv.contracts.plugin import PluginOptions
from lmkv.plugins.registry import KINDS, describe_exception

if TYPE_CHECKING:
    from lmkv.contracts.connector import GPUConnector
    from lmkv.contracts.policy import EvictionPolicy, OffloadPolicy
    from lmkv.contracts.serde import Serializer
    from lmkv.contracts.tier import StorageBackend

P = TypeVar("P")


@dataclass(frozen=True)
class Resolved(Generic[P]):
    """One plugin a config selects: its class and its options, already validated."""

    cls: type[P]
    options: PluginOptions

    def create(self, context: Any) -> P:
        """The plugin, built the one way every kind is built: ``cls(options, context)``.

        What a plugin's constructor raises that is not lmkv's own error (a
        ``ConfigError`` it raises says what is wrong already) becomes one line
        naming the plugin: a plugin never takes lmkv down with its traceback.
        """
        try:
            return self.cls(self.options, context)  # type: ignore[call-arg]
        except LMKVError:
            raise
        except Exception as exc:
            raise PluginError(f"{_describe(self.cls)} could not be built: "
                              f"{describe_exception(exc)}") from exc


@dataclass(frozen=True)
class ResolvedTier:
    """One storage tier: its backend and that tier's eviction policy."""

    backend: Resolved[StorageBackend]
    eviction: Resolved[EvictionPolicy]


@dataclass(frozen=True)
class ResolvedPlugins:
    """Every plugin a config selects. ``gpu_connector`` is None when the config leaves
    the choice to the integration: then ``connector_for`` gives the default for the
    KV the integration has (``lmkv.config.model.DEFAULT_CONNECTORS``), resolved at load too; a
    default that is not installed is an error only for a caller that needs it."""

    tiers: tuple[ResolvedTier, ...]
    serializer: Resolved[Serializer]
    offload_policy: Resolved[OffloadPolicy]
    gpu_connector: Resolved[GPUConnector] | None = None
    #: KV kind -> its default connector, or the one-line reason it cannot be had.
    default_connectors: Mapping[str, Resolved[GPUConnector] | str] = field(
        default_factory=dict)

    def connector_for(self, kv_kind: str) -> Resolved[GPUConnector]:
        """The config's ``gpu_connector``, else the default one for ``kv_kind``."""
        if self.gpu_connector is not None:
            return self.gpu_connector
        default = self.default_connectors.get(kv_kind)
        if default is None:
            raise ConfigError(f"gpu_connector is not set and there is no default connector "
                              f"for {kv_kind!r} KV; set gpu_connector "
                              f"(defaults exist for: {', '.join(self.default_connectors)})")
        if isinstance(default, str):
            raise ConfigError(default)
        return default


def _describe(cls: type) -> str:
    """``storage backend 'foo' (pkg.module.Foo)``: what a message names."""
    title = next((k.title for k in KINDS.values() if issubclass(cls, k.base_class())),
                 "plugin")
    return (f"{title} '{getattr(cls, 'name', '?')}' "
            f"({cls.__module__}.{cls.__qualname__})")
