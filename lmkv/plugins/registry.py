"""Name -> class registry for every plugin kind.

Names are matched case-insensitively. A class that breaks the contract (not a
subclass of its kind's ABC, no ``name``, a bad ``Options``, a serializer id
outside 1..255 or taken, a name already taken, or what ``lmkv.plugins.contract``
finds: another contract version, an abstract method, a constructor or method
lmkv cannot call) is recorded as a load failure of its plugin and left out: one
bad plugin never disables the others, and a config that selects a class left
out is told why. In a name
clash a built-in (distribution ``lmkv``) wins, else the first registration.
An unknown name is an error that suggests the nearest name, lists what is
available, says how to install a known plugin that is missing, and reports
plugins that failed to load or were skipped by the env lists.

Each kind keeps its own table of entries, typed by its base class, so a
look-up by kind (``registry.get(STORAGE_BACKEND, "cpu")``) is a
``type[StorageBackend]`` for the type checker, with no cast: adding a kind is a
``PluginKind`` constant, a table below and a line in ``KINDS``.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from pydantic import BaseModel

from lmkv.base.errors import DuplicatePluginError, PluginError, UnknownPluginError
from lmkv.plugins.contract import check

if TYPE_CHECKING:
    from lmkv.contracts.connector import GPUConnector
    from lmkv.contracts.policy import EvictionPolicy, OffloadPolicy
    from lmkv.contracts.serde import Serializer
    from lmkv.contracts.tier import StorageBackend

logger = logging.getLogger(__name__)

BUILTIN_DISTRIBUTION = "lmkv"
#: A frame stores the serializer id in one byte; 0 means "not set".
SERIALIZER_IDS = range(1, 256)


P = TypeVar("P")
#: An entry is read-only, so one of a subclass is an entry of its base class.
P_co = TypeVar("P_co", covariant=True)


@dataclass(frozen=True)
class PluginKind(Generic[P]):
    key: str  # used in config paths and `lmkv plugins`
    hook: str  # hookspec that returns classes of this kind
    title: str  # human name in messages
    # "module:Class" of the ABC, imported when first needed: the ABCs import torch,
    # which reading a config or listing plugins never needs.
    base: str
    #: This kind's table in a registry: what keeps a look-up typed by kind.
    table: Callable[[Registry], dict[str, PluginEntry[P]]] = field(repr=False, compare=False)

    def base_class(self) -> type[P]:
        module, _, attr = self.base.partition(":")
        base = getattr(importlib.import_module(module), attr)
        if not isinstance(base, type):
            raise TypeError(f"{self.base} (the base of {self.title} plugins) is not a class")
        return base


STORAGE_BACKEND: PluginKind[StorageBackend] = PluginKind(
    "storage_backend", "lmkv_storage_backends", "storage backend",
    "lmkv.contracts.tier:StorageBackend", lambda r: r._storage_backends)
EVICTION_POLICY: PluginKind[EvictionPolicy] = PluginKind(
    "eviction_policy", "lmkv_eviction_policies", "eviction policy",
    "lmkv.contracts.policy:EvictionPolicy", lambda r: r._eviction_policies)
OFFLOAD_POLICY: PluginKind[OffloadPolicy] = PluginKind(
    "offload_policy", "lmkv_offload_policies", "offload policy",
    "lmkv.contracts.policy:OffloadPolicy", lambda r: r._offload_policies)
SERIALIZER: PluginKind[Serializer] = PluginKind(
    "serializer", "lmkv_serializers", "serializer",
    "lmkv.contracts.serde:Serializer", lambda r: r._serializers)
GPU_CONNECTOR: PluginKind[GPUConnector] = PluginKind(
    "gpu_connector", "lmkv_gpu_connectors", "GPU connector",
    "lmkv.contracts.connector:GPUConnector", lambda r: r._gpu_connectors)

KINDS: dict[str, PluginKind[Any]] = {
    k.key: k
    for k in (STORAGE_BACKEND, EVICTION_POLICY, OFFLOAD_POLICY, SERIALIZER, GPU_CONNECTOR)
}


def as_kind(kind: PluginKind[P] | str) -> PluginKind[Any]:
    """The kind ``kind`` names (its ``key``: ``"storage_backend"``, ...)."""
    if isinstance(kind, PluginKind):
        return kind
    try:
        return KINDS[kind]
    except KeyError:
        raise PluginError(f"unknown plugin kind {kind!r}; "
                          f"known kinds: {', '.join(KINDS)}") from None


# Plugins that lmkv knows of but does not ship: (kind, name) -> distribution.
KNOWN_PLUGINS: dict[tuple[str, str], str] = {
    ("storage_backend", "redis"): "lmkv-redis",
    ("storage_backend", "mooncake"): "lmkv-mooncake",
}


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin came from: an entry point of a distribution, or run-time registration."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION

    def describe(self) -> str:
        if self.distribution:
            return f"{self.plugin} ({self.distribution} {self.version})"
        return f"{self.plugin} (registered at run time)"


@dataclass(frozen=True)
class PluginEntry(Generic[P_co]):
    kind: str
    name: str
    cls: type[P_co]
    source: PluginSource


@dataclass(frozen=True)
class LoadFailure:
    source: PluginSource
    error: str


@dataclass(frozen=True)
class Undeclared:
    """A class taken although it declares no ``api_version``."""

    source: PluginSource
    kind: str
    name: str


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line, whatever the exception does: a plugin's
    exception whose ``__str__`` raises is shown by its type name alone."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:  # a plugin's broken __str__ must not escape
        return f"{name} (its message cannot be shown: its __str__ raises)"
    return " ".join(f"{name}: {text}".split()) if text else name


@dataclass
class Registry:
    failures: list[LoadFailure] = field(default_factory=list)
    skipped: list[PluginSource] = field(default_factory=list)  # left out by the env lists
    #: What the env lists did, one sentence naming the variable (empty: nothing skipped).
    env_note: str = ""
    #: Classes taken without an ``api_version`` (one warning per plugin).
    undeclared: list[Undeclared] = field(default_factory=list)
    #: ``(kind, lower-case name)`` of a class left out -> why, for a config selecting it.
    left_out: dict[tuple[str, str], str] = field(default_factory=dict)
    # One table per kind, lower-case name -> entry (``PluginKind.table`` picks one).
    _storage_backends: dict[str, PluginEntry[StorageBackend]] = field(default_factory=dict)
    _eviction_policies: dict[str, PluginEntry[EvictionPolicy]] = field(default_factory=dict)
    _offload_policies: dict[str, PluginEntry[OffloadPolicy]] = field(default_factory=dict)
    _serializers: dict[str, PluginEntry[Serializer]] = field(default_factory=dict)
    _gpu_connectors: dict[str, PluginEntry[GPUConnector]] = field(default_factory=dict)

    def add(self, kind: PluginKind[Any] | str, cls: object, source: PluginSource) -> None:
        """Add one class; raises PluginError (DuplicatePluginError on a clash)
        if it breaks the contract. ``add_all`` records instead of raising."""
        self._add(as_kind(kind), cls, source)

    def _add(self, spec: PluginKind[P], cls: object, source: PluginSource) -> None:
        kind = spec.key
        base = spec.base_class()
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(
                f"plugin {source.describe()} returned {cls!r} from {spec.hook}; "
                f"expected a subclass of {base.__module__}.{base.__qualname__}"
            )
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            raise PluginError(
                f"{spec.title} class {cls.__qualname__} from {source.describe()} "
                "has no `name`"
            )
        options = getattr(cls, "Options", None)
        if not (isinstance(options, type) and issubclass(options, BaseModel)
                and options.model_config.get("extra") == "forbid"):
            raise PluginError(
                f"{spec.title} '{name}' from {source.describe()}: `Options` must be a "
                "pydantic model with extra='forbid' (subclass lmkv.PluginOptions)"
            )
        verdict = check(kind, cls, base)
        if verdict.problem:
            reason = " ".join(f"{spec.title} '{name}' ({cls.__module__}.{cls.__qualname__}): "
                              f"{verdict.problem}".split())
            self.left_out[(kind, name.lower())] = f"{reason} ({source.describe()})"
            raise PluginError(reason)
        entry = PluginEntry(kind, name, cls, source)
        if spec is SERIALIZER:
            self._check_serializer_id(entry)
        table = spec.table(self)
        existing = table.get(name.lower())
        if existing is not None:
            self._resolve_clash(existing, entry,
                                f"{spec.title} '{name}' is registered twice: by "
                                f"{existing.source.describe()} and by {source.describe()}")
        table[name.lower()] = entry
        self.left_out.pop((kind, name.lower()), None)
        if verdict.undeclared:
            self.undeclared.append(Undeclared(source, spec.title, name))

    def _check_serializer_id(self, entry: PluginEntry[object]) -> None:
        sid = getattr(entry.cls, "serializer_id", None)
        if isinstance(sid, bool) or not isinstance(sid, int) or sid not in SERIALIZER_IDS:
            raise PluginError(
                f"serializer '{entry.name}' from {entry.source.describe()}: serializer_id = "
                f"{sid!r}; allowed: an integer from 1 to 255 (one byte in every frame)"
            )
        for other in list(self._serializers.values()):
            if other.cls.serializer_id == sid and other.name.lower() != entry.name.lower():
                self._resolve_clash(other, entry,
                                    f"serializer_id {sid} is used twice: by serializer "
                                    f"'{other.name}' of {other.source.describe()} and by "
                                    f"'{entry.name}' of {entry.source.describe()}")

    def _resolve_clash(self, existing: PluginEntry[object], new: PluginEntry[object],
                       message: str) -> None:
        """Keep ``existing`` by raising, unless ``new`` is a built-in replacing a
        plugin's entry: then the plugin's entry becomes the recorded failure."""
        if new.source.builtin and not existing.source.builtin:
            KINDS[existing.kind].table(self).pop(existing.name.lower(), None)
            self._record(existing.source, DuplicatePluginError(message + "; the built-in wins"))
            return
        if existing.source.builtin:
            message += "; the built-in wins"
        raise DuplicatePluginError(message)

    def add_all(self, kind: PluginKind[Any] | str, classes: object,
                source: PluginSource) -> None:
        """Add what a hook returned; each bad class is recorded, never fatal to others."""
        if classes is None:
            return
        items = classes if isinstance(classes, (list, tuple)) else [classes]
        for cls in items:
            try:
                self.add(kind, cls, source)
            except Exception as exc:  # a class that breaks even the looking at it
                self._record(source, exc)

    def _record(self, source: PluginSource, exc: BaseException) -> None:
        # Not logged here: the manager logs one line per plugin once the registry is built.
        # A plain PluginError says what it is; another type's name is part of the news.
        error = " ".join(str(exc).split()) if type(exc) is PluginError else \
            describe_exception(exc)
        self.failures.append(LoadFailure(source, error))

    def names(self, kind: PluginKind[Any] | str) -> list[str]:
        return sorted(e.name for e in as_kind(kind).table(self).values())

    def entries(self) -> Iterable[PluginEntry[object]]:
        for kind in KINDS.values():
            yield from sorted(kind.table(self).values(), key=lambda e: e.name)

    @overload
    def get(self, kind: PluginKind[P], name: str) -> type[P]: ...
    @overload
    def get(self, kind: str, name: str) -> type: ...

    def get(self, kind: PluginKind[Any] | str, name: str) -> type:
        """The class registered as ``name``: typed by kind when ``kind`` is a
        ``PluginKind`` (``STORAGE_BACKEND``, ...), a plain class for its key."""
        return self._get(as_kind(kind), name)

    def _get(self, spec: PluginKind[P], name: str) -> type[P]:
        entry = spec.table(self).get(name.lower())
        if entry is not None:
            return entry.cls
        reason = self.left_out.get((spec.key, name.lower()))
        if reason is not None:
            raise UnknownPluginError(f"{reason}; it was left out at load")
        raise self._unknown(spec, name)

    def _unknown(self, spec: PluginKind[Any], name: str) -> UnknownPluginError:
        kind = spec.key
        names = self.names(spec)
        by_lower = {n.lower(): n for n in names}
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
        hint = f"did you mean '{by_lower[close[0]]}'? " if close else ""
        msg = f"unknown {spec.title} '{name}'; {hint}available: {', '.join(names) or 'none'}"
        dist = KNOWN_PLUGINS.get((kind, name.lower()))
        failed = [f for f in self.failures if dist and f.source.distribution == dist]
        if dist and any(s.distribution == dist for s in self.skipped):
            return UnknownPluginError(
                f"{msg}. '{name}' comes from {dist}, which is installed but skipped by "
                "LMKV_LOAD_PLUGINS/LMKV_DISABLE_PLUGINS")
        if failed:
            return UnknownPluginError(
                f"{msg}. '{name}' comes from {dist}, which failed to load: {failed[0].error}")
        if dist:
            return UnknownPluginError(
                f"{msg}. '{name}' is provided by {dist}: pip install {dist}")
        if self.failures:
            broken = "; ".join(f"{f.source.describe()}: {f.error}" for f in self.failures)
            msg += f" (plugins that failed to load: {broken})"
        note = ""
        if self.skipped:
            note = self.env_note or ("plugins skipped by LMKV_LOAD_PLUGINS/LMKV_DISABLE_PLUGINS: "
                                     + ", ".join(s.describe() for s in self.skipped))
        return UnknownPluginError(msg, env_note=note)
