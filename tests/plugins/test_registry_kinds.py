"""The registry keeps one table per plugin kind: a look-up by kind gives a class
of that kind, and the kind's key (``"storage_backend"``) still works."""

from __future__ import annotations

import pytest

from lmkv.base.errors import PluginError
from lmkv.plugins.manager import PluginManager
from lmkv.plugins.registry import (
    EVICTION_POLICY,
    KINDS,
    SERIALIZER,
    STORAGE_BACKEND,
    PluginSource,
    Registry,
)
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    manager = PluginManager()
    manager.load_entry_points()
    return manager


def test_a_look_up_by_kind_and_by_its_key_agree(manager: PluginManager) -> None:
    registry = manager.registry
    assert registry.get(STORAGE_BACKEND, "cpu") is CPUBackend
    assert registry.get("storage_backend", "CPU") is CPUBackend
    assert registry.get(EVICTION_POLICY, "lru") is LRUPolicy
    assert manager.serializer("naive") is NaiveSerializer


def test_each_table_holds_only_its_kind(manager: PluginManager) -> None:
    for kind in KINDS.values():
        base = kind.base_class()
        entries = kind.table(manager.registry)
        assert entries, kind.key
        for entry in entries.values():
            assert entry.kind == kind.key and issubclass(entry.cls, base)


def test_a_class_of_one_kind_is_not_found_under_another() -> None:
    registry = Registry()
    registry.add(STORAGE_BACKEND, CPUBackend, PluginSource("a"))
    assert registry.names(STORAGE_BACKEND) == ["cpu"]
    assert registry.names(SERIALIZER) == []
    with pytest.raises(PluginError, match="unknown serializer 'cpu'"):
        registry.get(SERIALIZER, "cpu")


def test_an_unknown_kind_key_names_the_known_ones() -> None:
    with pytest.raises(PluginError, match="unknown plugin kind 'tier'; known kinds: "
                                          "storage_backend, eviction_policy"):
        Registry().get("tier", "cpu")
