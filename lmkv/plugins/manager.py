"""Finds plugins through the ``lmkv`` entry-point group and builds the registry.

pluggy is used only at start-up, to collect classes; the data path talks to
the classes the registry hands out.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, cast

import pluggy

from lmkv.errors import PluginError
from lmkv.plugins import hookspecs
from lmkv.plugins.registry import KINDS, LoadFailure, PluginSource, Registry

if TYPE_CHECKING:
    from lmkv.backend import StorageBackend
    from lmkv.gpu import GPUConnector
    from lmkv.policy import EvictionPolicy, OffloadPolicy
    from lmkv.serde import Serializer

logger = logging.getLogger(__name__)

LOAD_ENV = "LMKV_LOAD_PLUGINS"
DISABLE_ENV = "LMKV_DISABLE_PLUGINS"


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


@dataclass(frozen=True)
class SkippedPlugin:
    source: PluginSource
    reason: str


class PluginManager:
    """Typed front of pluggy: callers never touch ``pm.hook`` directly, and look a
    plugin up through one typed method per kind (``storage_backend(name)``, ...)."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, PluginSource] = {}
        self._failures: list[LoadFailure] = []
        self.skipped: list[SkippedPlugin] = []
        self._registry: Registry | None = None
        self._lock = threading.Lock()

    # -- discovery ---------------------------------------------------------
    def load_entry_points(self) -> None:
        allow, block = _env_list(LOAD_ENV), _env_list(DISABLE_ENV)
        for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            source = _source_of(ep)
            names = {ep.name, source.distribution}
            if allow is not None and not names & allow:
                self.skipped.append(SkippedPlugin(source, f"not in {LOAD_ENV}"))
                continue
            if block is not None and names & block:
                self.skipped.append(SkippedPlugin(source, f"listed in {DISABLE_ENV}"))
                continue
            known = self._sources.get(ep.name)
            if known is not None:
                if known.distribution != source.distribution:
                    self._record_failure(source, PluginError(
                        f"entry point name {ep.name!r} is already used by "
                        f"{known.describe()}"))
                continue  # else: the same distribution seen twice on sys.path
            try:
                plugin = ep.load()
                self.register(plugin, source=source)
            except Exception as exc:  # any import or registration error is the plugin's
                self._record_failure(source, exc)

    def register(self, plugin: object, name: str | None = None,
                 source: PluginSource | None = None) -> str:
        """Register a module or object with ``@hookimpl`` functions; returns its name."""
        with self._lock:
            source = source or PluginSource(name or _default_name(plugin))
            registered = self._pm.register(plugin, name=source.plugin)
            if registered is None:
                raise ValueError(f"plugin {source.plugin!r} is already registered")
            self._sources[registered] = source
            self._registry = None
            return registered

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)
            self._sources.pop(name, None)
            self._registry = None

    def _record_failure(self, source: PluginSource, exc: BaseException,
                        failures: list[LoadFailure] | None = None) -> None:
        error = " ".join(f"{type(exc).__name__}: {exc}".split())  # always one line
        logger.warning("lmkv plugin %s failed to load: %s", source.describe(), error)
        (self._failures if failures is None else failures).append(LoadFailure(source, error))

    # -- registry ----------------------------------------------------------
    @property
    def registry(self) -> Registry:
        with self._lock:
            if self._registry is None:
                self._registry = self._build_registry()
            return self._registry

    def _build_registry(self) -> Registry:
        registry = Registry(failures=list(self._failures),
                            skipped=[s.source for s in self.skipped])
        for kind in KINDS.values():
            caller = getattr(self._pm.hook, kind.hook)
            for impl in caller.get_hookimpls():  # registration order
                source = self._sources.get(impl.plugin_name, PluginSource(impl.plugin_name))
                try:
                    classes = impl.function()
                except Exception as exc:
                    self._record_failure(source, exc, registry.failures)
                    continue
                registry.add_all(kind.key, classes, source)
        return registry

    # -- one typed method per kind (an unknown name raises UnknownPluginError) --
    def storage_backend(self, name: str) -> type[StorageBackend]:
        return cast("type[StorageBackend]", self.registry.get("storage_backend", name))

    def eviction_policy(self, name: str) -> type[EvictionPolicy]:
        return cast("type[EvictionPolicy]", self.registry.get("eviction_policy", name))

    def offload_policy(self, name: str) -> type[OffloadPolicy]:
        return cast("type[OffloadPolicy]", self.registry.get("offload_policy", name))

    def serializer(self, name: str) -> type[Serializer]:
        return cast("type[Serializer]", self.registry.get("serializer", name))

    def gpu_connector(self, name: str) -> type[GPUConnector]:
        return cast("type[GPUConnector]", self.registry.get("gpu_connector", name))


def _source_of(ep: EntryPoint) -> PluginSource:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return PluginSource(ep.name)
    return PluginSource(ep.name, dist.metadata["Name"], dist.version)


def _default_name(plugin: object) -> str:
    return getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, with entry points loaded on first use."""
    global _manager
    with _manager_lock:
        if _manager is None:
            manager = PluginManager()
            manager.load_entry_points()
            _manager = manager
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests; after changing the env lists)."""
    global _manager
    with _manager_lock:
        _manager = None


def swap_plugin_manager(manager: PluginManager | None) -> PluginManager | None:
    """Install ``manager`` as the process-wide one; returns the previous (tests)."""
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
        return previous
