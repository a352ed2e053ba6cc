"""Register plugins for the length of a block or a test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lmkv.plugins.manager import PluginManager, swap_plugin_manager


@contextmanager
def fresh_plugin_manager(load_entry_points: bool = True) -> Iterator[PluginManager]:
    """A new process-wide plugin manager inside the block; the old one after it."""
    manager = PluginManager()
    if load_entry_points:
        manager.load_entry_points()
    previous = swap_plugin_manager(manager)
    try:
        yield manager
    finally:
        swap_plugin_manager(previous)


@contextmanager
def registered_plugin(plugin: object, name: str | None = None) -> Iterator[PluginManager]:
    """Make ``plugin`` (a module or object with ``@hookimpl`` functions) available
    to lmkv inside the block, on top of the installed plugins."""
    with fresh_plugin_manager() as manager:
        manager.register(plugin, name=name)
        yield manager


@contextmanager
def builtins_only() -> Iterator[PluginManager]:
    """Inside the block, lmkv sees its built-in plugins only, as on a machine
    where no plugin package is installed (a config naming a plugin's tier gets
    the "pip install" error)."""
    import lmkv_backends.plugin
    import lmkv_policies.plugin

    with fresh_plugin_manager(load_entry_points=False) as manager:
        manager.register(lmkv_backends.plugin, name="lmkv_backends")
        manager.register(lmkv_policies.plugin, name="lmkv_policies")
        yield manager
