"""Plugins built the way lmkv builds them, for tests and the conformance kits.

A kit that built a plugin by hand would pass a class lmkv cannot build (a
constructor lmkv does not call that way) or a tier that only works on its own.
These helpers go through lmkv's own path: the class checked as the registry
checks it at load, its ``Options`` validated from a mapping, ``cls(options,
context)``; a tier inside a storage manager made by ``load_config`` and
``StorageManager.from_config`` from a config that names it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from lmkv.base.errors import PluginError
from lmkv.config.model import LMKVConfig, load_config
from lmkv.contracts.hooks import hookimpl
from lmkv.plugins.contract import check
from lmkv.plugins.manager import get_plugin_manager
from lmkv.plugins.registry import KINDS
from lmkv.plugins.resolved import Resolved
from lmkv.storage.manager import StorageManager
from lmkv.testing.plugins import fresh_plugin_manager

P = TypeVar("P")


def plugin_class(kind: str, name: str) -> type:
    """The installed ``kind`` class selected by ``name`` (``plugin_class("storage_backend",
    "cpu")``): a built-in to extend or build by hand in a test."""
    return get_plugin_manager().registry.get(kind, name)


def kind_of(cls: type) -> str:
    """The plugin kind ``cls`` is (``storage_backend``, ...), from its base class."""
    for key, kind in KINDS.items():
        if issubclass(cls, kind.base_class()):
            return key
    raise TypeError(f"{cls!r} is not a subclass of any lmkv plugin base class")


def load_problem(cls: type) -> str:
    """Why lmkv's load check would leave ``cls`` out ("" when it fits)."""
    kind = kind_of(cls)
    return check(kind, cls, KINDS[kind].base_class()).problem


def build_plugin(cls: type[P], options: Mapping[str, Any] | None, context: object) -> P:
    """``cls`` built as lmkv builds a plugin a config selects: ``options`` validated
    by ``cls.Options``, then ``cls(options, context)``."""
    validated = cls.Options.model_validate(dict(options or {}))  # type: ignore[attr-defined]
    return Resolved(cls, validated).create(context)


class _Provides:
    """A hook object that hands lmkv one class under its kind's hook."""

    def __init__(self, cls: type) -> None:
        hook = KINDS[kind_of(cls)].hook

        @hookimpl
        def provide() -> list[type]:
            return [cls]

        setattr(self, hook, provide)


@contextmanager
def selectable(*classes: type) -> Iterator[None]:
    """Each of ``classes`` selectable by its ``name`` in a config inside the block:
    the installed plugins as they are when they already resolve every name to
    its class, else the missing classes registered on top of them in one fresh
    plugin manager."""
    missing = [cls for cls in classes if _resolved(cls) is not cls]
    if not missing:
        yield
        return
    with fresh_plugin_manager() as manager:
        for cls in missing:
            manager.register(_Provides(cls), name=f"kit-{cls.__module__}.{cls.__qualname__}")
        for cls in missing:
            found = _resolved(cls)
            if found is not cls:  # a built-in or an installed plugin holds the name
                raise PluginError(
                    f"{cls.__module__}.{cls.__qualname__} cannot be selected by its name "
                    f"{cls.name!r}: it is taken by "  # type: ignore[attr-defined]
                    f"{'nothing' if found is None else found.__module__ + '.' + found.__qualname__}"
                    f" (give the class a name of its own; a left-out class says why: "
                    f"{load_problem(cls) or 'it fits the contract'})")
        yield


def _resolved(cls: type) -> type | None:
    try:
        return get_plugin_manager().registry.get(kind_of(cls), cls.name)  # type: ignore[attr-defined]
    except PluginError:
        return None


def config_of(tiers: Sequence[Mapping[str, Any]], **keys: Any) -> LMKVConfig:
    """A config with these ``tiers`` (and other top-level ``keys``), as lmkv loads
    one: nothing from this process's environment or files."""
    overrides = {"lmkv.tiers": [dict(t) for t in tiers],
                 **{f"lmkv.{k}": v for k, v in keys.items()}}
    return load_config(env={}, overrides=overrides)


def storage_from(tiers: Sequence[Mapping[str, Any]], **keys: Any) -> StorageManager:
    """The storage manager lmkv builds from a config naming ``tiers`` (each a
    ``{type, options, eviction}`` mapping); the classes it names must be
    selectable (``selectable``)."""
    return StorageManager.from_config(config_of(tiers, **keys))
