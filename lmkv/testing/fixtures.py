"""pytest fixtures for lmkv plugin authors (auto-loaded via the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from lmkv.plugins.manager import PluginManager
from lmkv.testing.plugins import fresh_plugin_manager


@pytest.fixture
def lmkv_plugin_manager() -> Iterator[PluginManager]:
    """A fresh process-wide plugin manager (installed plugins loaded) for one test."""
    with fresh_plugin_manager() as manager:
        yield manager


@pytest.fixture
def register_lmkv_plugin(lmkv_plugin_manager: PluginManager) -> Callable[..., str]:
    """``register_lmkv_plugin(module_or_object, name=None)``: registered until the test ends."""

    def register(plugin: object, name: str | None = None) -> str:
        return lmkv_plugin_manager.register(plugin, name=name)

    return register
