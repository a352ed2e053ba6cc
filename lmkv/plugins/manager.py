"""Finds plugins through the ``lmkv`` entry-point group and builds the registry.

pluggy is used only at start-up, to collect classes; the data path talks to
the classes the registry hands out. A plugin cannot take lmkv down while it
loads: what it raises (``SystemExit`` too) is its recorded failure, what it
prints goes to stderr (stdout may be ``lmkv plugins --json``), and a hook
function that matches no hookspec (a typo) is a failure, not silence.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import logging
import os
import sys
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, EntryPoints
from typing import TYPE_CHECKING

import pluggy

from lmkv.base.errors import PluginError
from lmkv.contracts import hooks as hookspecs
from lmkv.plugins.contract import undeclared_note
from lmkv.plugins.registry import (
    EVICTION_POLICY,
    GPU_CONNECTOR,
    KINDS,
    OFFLOAD_POLICY,
    SERIALIZER,
    STORAGE_BACKEND,
    LoadFailure,
    PluginSource,
    Registry,
    Undeclared,
    describe_exception,
)

if TYPE_CHECKING:
    from lmkv.contracts.connector import GPUConnector
    from lmkv.contracts.policy import EvictionPolicy, OffloadPolicy
    from lmkv.contracts.serde import Serializer
    from lmkv.contracts.tier import StorageBackend

logger = logging.getLogger(__name__)

LOAD_ENV = "LMKV_LOAD_PLUGINS"
DISABLE_ENV = "LMKV_DISABLE_PLUGINS"


def entry_points(group: str) -> EntryPoints:
    """The installed entry points of ``group``, looked up at each call (a process
    that filters ``importlib.metadata`` is heard)."""
    return importlib.metadata.entry_points(group=group)


def _env_list(name: str) -> set[str] | None:
    """The names in ``name``; None when it is unset or blank. Commas only (``,,,``)
    is an empty list: LMKV_LOAD_PLUGINS then loads no plugin, and a config that
    selects any says so in one line (see ``_env_note``)."""
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
        self.installed: list[PluginSource] = []  # every entry point seen, skipped or not
        #: What LMKV_LOAD_PLUGINS / LMKV_DISABLE_PLUGINS did, in one sentence ("": nothing).
        self.env_note = ""
        self._registry: Registry | None = None
        self._lock = threading.Lock()

    # -- discovery ---------------------------------------------------------
    def load_entry_points(self) -> None:
        """Load the ``lmkv`` entry points the env lists let through (stdout goes to
        stderr meanwhile); each failure is recorded, never raised."""
        allow, block = _env_list(LOAD_ENV), _env_list(DISABLE_ENV)
        with contextlib.redirect_stdout(sys.stderr):
            for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
                self._load(ep, allow, block)
        self.env_note = _env_note(allow, block, self.installed, self.skipped)

    def _load(self, ep: EntryPoint, allow: set[str] | None, block: set[str] | None) -> None:
        source = _source_of(ep)
        if source in self.installed:
            return  # the same distribution seen twice on sys.path
        self.installed.append(source)
        names = {ep.name, source.distribution}
        if allow is not None and not names & allow:
            self.skipped.append(SkippedPlugin(source, f"not in {LOAD_ENV}"))
            return
        if block is not None and names & block:
            self.skipped.append(SkippedPlugin(source, f"listed in {DISABLE_ENV}"))
            return
        known = self._sources.get(ep.name)
        if known is not None:
            if known.distribution != source.distribution:
                self._record_failure(source, PluginError(
                    f"entry point name {ep.name!r} is already used by {known.describe()}"))
            return  # else: the same distribution seen twice on sys.path
        try:
            plugin = ep.load()
            self.register(plugin, source=source)
        # Any import or registration error is the plugin's, sys.exit() at import too;
        # KeyboardInterrupt is the user's and still stops lmkv.
        except (Exception, SystemExit) as exc:
            self._record_failure(source, exc)

    def register(self, plugin: object, name: str | None = None,
                 source: PluginSource | None = None) -> str:
        """Register a module or object with ``@hookimpl`` functions; returns its name."""
        with self._lock:
            source = source or PluginSource(name or _default_name(plugin))
            registered = self._pm.register(plugin, name=source.plugin)
            if registered is None:
                raise ValueError(f"plugin {source.plugin!r} is already registered")
            unknown = _unknown_hooks(self._pm, plugin)
            if unknown:
                self._pm.unregister(plugin)
                raise PluginError(unknown)
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
        # Logged with the plugin's other problems, one line per plugin (``_report``).
        error = describe_exception(exc)  # always one line
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
                            skipped=[s.source for s in self.skipped], env_note=self.env_note)
        for kind in KINDS.values():
            caller = getattr(self._pm.hook, kind.hook)
            for impl in caller.get_hookimpls():  # registration order
                source = self._sources.get(impl.plugin_name, PluginSource(impl.plugin_name))
                try:
                    with contextlib.redirect_stdout(sys.stderr):
                        classes = impl.function()
                except (Exception, SystemExit) as exc:
                    self._record_failure(source, exc, registry.failures)
                    continue
                registry.add_all(kind, classes, source)
        _report(registry.failures, registry.undeclared)
        return registry

    # -- one typed method per kind (an unknown name raises UnknownPluginError) --
    def storage_backend(self, name: str) -> type[StorageBackend]:
        return self.registry.get(STORAGE_BACKEND, name)

    def eviction_policy(self, name: str) -> type[EvictionPolicy]:
        return self.registry.get(EVICTION_POLICY, name)

    def offload_policy(self, name: str) -> type[OffloadPolicy]:
        return self.registry.get(OFFLOAD_POLICY, name)

    def serializer(self, name: str) -> type[Serializer]:
        return self.registry.get(SERIALIZER, name)

    def gpu_connector(self, name: str) -> type[GPUConnector]:
        return self.registry.get(GPU_CONNECTOR, name)


def _report(failures: list[LoadFailure], undeclared: list[Undeclared]) -> None:
    """One warning line per plugin with a problem: what failed or was left out, the
    classes that declare no ``api_version``, and how to silence the plugin."""
    sources = list(dict.fromkeys([*(f.source for f in failures),
                                  *(u.source for u in undeclared)]))
    for source in sources:
        parts = [f.error for f in failures if f.source == source]
        if parts:
            parts[0] = f"left out: {parts[0]}"
        mine = [u for u in undeclared if u.source == source]
        if mine:
            named = ", ".join(f"{u.kind} '{u.name}'" for u in mine)
            parts.append(f"{named} declare{'s' if len(mine) == 1 else ''} no api_version; "
                         f"{undeclared_note(len(mine))}")
        logger.warning("lmkv plugin %s: %s; %s", source.describe(), "; ".join(parts),
                       silence_hint(source))


def silence_hint(source: PluginSource) -> str:
    """How to stop lmkv loading ``source`` (the env list takes either name)."""
    if source.distribution is None:
        return "registered at run time"
    return f"to skip it: {DISABLE_ENV}={source.distribution}"


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> str:
    """Why ``plugin`` has a ``@hookimpl`` that matches no hookspec (pluggy accepts
    one and never calls it: a typo would register nothing, silently); "" if none."""
    unknown = sorted(c.name for c in pm.get_hookcallers(plugin) or () if not c.has_spec())
    if not unknown:
        return ""
    known = sorted(k.hook for k in KINDS.values())
    close = difflib.get_close_matches(unknown[0], known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"@hookimpl {', '.join(repr(n) for n in unknown)} matches no lmkv hook; "
            f"{hint}known hooks: {', '.join(known)}")


def _env_note(allow: set[str] | None, block: set[str] | None,
              installed: list[PluginSource], skipped: list[SkippedPlugin]) -> str:
    """One sentence naming each env list that skipped plugins and what it did, for
    the one line a config whose plugins it made unavailable gets ("" if none did)."""
    parts = []
    for env, names, reason in ((LOAD_ENV, allow, f"not in {LOAD_ENV}"),
                               (DISABLE_ENV, block, f"listed in {DISABLE_ENV}")):
        left_out = [s.source.describe() for s in skipped if s.reason == reason]
        if names is None or not left_out:
            continue
        shown = f"{env}={_clip(os.environ.get(env, '').strip())}"
        every = ("so every plugin is skipped (installed: "
                 f"{', '.join(s.describe() for s in installed)})")
        if env == LOAD_ENV and not names:
            parts.append(f"{shown} names no plugin, {every}")
        elif env == LOAD_ENV and len(left_out) == len(installed):
            parts.append(f"{shown} names no installed plugin, {every}")
        else:
            parts.append(f"skipped by {shown}: {', '.join(left_out)}")
    return "; ".join(parts)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
