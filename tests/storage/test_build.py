"""Tiers are built memory first: the others are handed its allocator when built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmkv import load_config
from lmkv.contracts.tier import ArenaPlacement, BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.storage.build import tensor_allocate
from lmkv.storage.manager import StorageManager
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_backends.tiers.fs import FSBackend

SHAPE = (2, 2, 8, 2, 8)


def key(i: int) -> CacheKey:
    return CacheKey(KeyMeta("m"), i.to_bytes(32, "little"))


@pytest.fixture
def built_with(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, object]]:
    """(tier name, tier_index, what its allocate gave at build time), in build order."""
    seen: list[tuple[str, int, object]] = []
    for cls in (CPUBackend, FSBackend):
        real = cls.__init__

        def init(self, options=None, context: BackendContext | None = None, *,
                 _real=real) -> None:  # type: ignore[no-untyped-def]
            assert context is not None
            got = context.allocate((4,), torch.uint8) if context.allocate else None
            seen.append((self.name, context.tier_index, got))
            if got is not None:
                got.ref_down()
            _real(self, options, context)

        monkeypatch.setattr(cls, "__init__", init)
    return seen


def test_the_memory_tier_is_built_first_and_the_others_get_its_arena(
        tmp_path: Path, built_with: list) -> None:
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "fs", "options": {"url": str(tmp_path)}},
        {"type": "cpu", "options": {"max_bytes": "1MiB"}}]})
    manager = StorageManager.from_config(config, arena=ArenaPlacement.SHARED)
    try:
        fs, memory = manager.tiers
        assert (fs.name, memory.name) == ("fs", "cpu")  # the config's order
        assert [(name, index) for name, index, _ in built_with] == [("cpu", 1), ("fs", 0)]
        # The fs tier could allocate from the arena while it was being built.
        assert built_with[1][2].allocator is memory.allocator
        # ... and reads into it now go through the manager (which may give up
        # queued writes to make room, as for a store)
        assert fs.context.allocate.target == manager.allocate
        assert memory.context.allocate is None  # it allocates from its own arena
        assert memory.context.arena is ArenaPlacement.SHARED
        assert fs.context.arena is ArenaPlacement.PRIVATE
        assert (fs.context.tier_index, memory.context.tier_index) == (0, 1)
    finally:
        manager.close()


def test_without_a_memory_tier_reads_decode_into_plain_tensors(tmp_path: Path) -> None:
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "fs", "options": {"url": str(tmp_path)}}]})
    manager = StorageManager.from_config(config)
    try:
        (fs,) = manager.tiers
        assert fs.context.allocate is tensor_allocate
        obj = manager.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(7)
        manager.put([key(0)], [obj]).result(10)
        (got,) = manager.get([key(0)])
        assert got.allocator is None and int(got.tensor.flatten()[0]) == 7
    finally:
        manager.close()


def test_a_closed_manager_is_not_kept_alive_by_its_tiers(tmp_path: Path) -> None:
    import gc
    import weakref

    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "1MiB"}},
        {"type": "fs", "options": {"url": str(tmp_path)}}]})
    gc.disable()
    try:
        manager = StorageManager.from_config(config)
        fs = manager.tiers[1]
        ref = weakref.ref(manager)
        manager.close()
        assert fs.context.allocate.target == fs.context.allocate.memory.allocate
        del manager
        assert ref() is None  # without a collection: no cycle through the tiers
    finally:
        gc.enable()
