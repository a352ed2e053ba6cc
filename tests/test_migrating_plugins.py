"""docs/migrating-plugins.md runs: each "before" class is one lmkv leaves out at
load, each "after" class one it takes (and the after blocks' own asserts hold),
and the kits of the after blocks pass."""

from __future__ import annotations

import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from lmkv.contracts.versions import API_VERSIONS
from lmkv.plugins.registry import KINDS
from lmkv.testing import (
    EvictionPolicyConformance,
    GPUConnectorConformance,
    StorageBackendConformance,
)
from lmkv.testing.building import load_problem

DOC = (Path(__file__).resolve().parents[1] / "docs" / "migrating-plugins.md").read_text()


def blocks() -> list[tuple[str, str, str]]:
    """``(section, "before" | "after", code)`` for every python block, in page order."""
    out = []
    for part in re.split(r"^### ", DOC, flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        for code in re.findall(r"```python\n(.*?)```", part, flags=re.S):
            side = code.splitlines()[0].strip().lstrip("# ")
            assert side in ("before", "after"), f"{title}: a block starts with {side!r}"
            out.append((title, side, code))
    return out


BLOCKS = blocks()


def _plugin_classes(namespace: dict, module: str) -> list[type]:
    bases = tuple(k.base_class() for k in KINDS.values())
    return [v for v in namespace.values() if isinstance(v, type) and issubclass(v, bases)
            and v not in bases and v.__module__ == module]


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    return module


def _run_after_blocks() -> dict:
    """Every after block, in page order, in one module (as one user's file)."""
    module = _module("migrating_plugins_after")
    for title, side, code in BLOCKS:
        if side == "after":
            exec(compile(code, f"migrating-plugins.md:{title}", "exec"), module.__dict__)
    return module.__dict__


AFTER = _run_after_blocks()


def test_the_page_covers_the_current_api() -> None:
    for version in set(API_VERSIONS.values()):
        assert f"(API {version})" in DOC, f"no section for the plugin API {version}"
    assert any(side == "before" for _, side, _ in BLOCKS)


@pytest.mark.parametrize("index", [i for i, (_, side, _) in enumerate(BLOCKS)
                                   if side == "before"])
def test_each_before_class_is_left_out(index: int) -> None:
    title, _, code = BLOCKS[index]
    module = _module(f"migrating_plugins_before_{index}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the 0.1 import paths
        exec(compile(code, f"migrating-plugins.md:{title}", "exec"), module.__dict__)
    for cls in _plugin_classes(module.__dict__, module.__name__):
        assert load_problem(cls), f"{title}: lmkv would take {cls.__name__} as it is"


def test_each_after_class_is_taken() -> None:
    classes = _plugin_classes(AFTER, "migrating_plugins_after")
    assert len(classes) >= 5
    for cls in classes:
        assert load_problem(cls) == "", f"{cls.__name__}: {load_problem(cls)}"


class TestAfterPolicyKit(AFTER["TestOldestFirst"], EvictionPolicyConformance):
    pass


class TestAfterBatchedPolicyKit(AFTER["TestBatchedArrivalOrder"]):
    """The 2.2 section's policy, which takes batches in one call."""


class TestAfterTierKit(AFTER["TestDictTier"], StorageBackendConformance):
    pass


class TestAfterMemoryTierKit(AFTER["TestMemoryDictTier"]):
    """The 2.2 section's tier, which says its lookups need no I/O."""


class TestAfterCountingTierKit(AFTER["TestCountingDictTier"]):
    """The 2.3 section's tier, which reads the memory tier it is handed."""

    def test_it_is_handed_the_memory_tier(self) -> None:
        storage = self.build_storage([{"type": "cpu", "options": {"max_bytes": "1MiB"}},
                                      self._tier_ref()])
        memory, tier = storage.tiers
        assert tier.context.memory is memory and memory.context.memory is None
        assert tier.stats()["also_in_memory"] == 0


class TestAfterConnectorKit(GPUConnectorConformance):
    """The heads-outer connector of the 2.1 section passes the GPU-connector kit."""

    connector_class = AFTER["HeadsOuterConnector"]

    def engine_state(self, spec, tokens, seed):  # type: ignore[no-untyped-def]
        return _one_tensor((spec.num_layers, spec.num_kv_heads, tokens, spec.kv_planes,
                            spec.head_dim), spec.dtype, seed)

    def token_kv(self, state, layer, token):  # type: ignore[no-untyped-def]
        return state["kv"][layer, :, token].transpose(0, 1)


class TestAfterCheckingConnectorKit(GPUConnectorConformance):
    """The checking connector of the 2.2 section passes the GPU-connector kit,
    its checked loads included."""

    connector_class = AFTER["CheckingConnector"]

    def engine_state(self, spec, tokens, seed):  # type: ignore[no-untyped-def]
        return _one_tensor((spec.num_layers, spec.kv_planes, tokens, spec.num_kv_heads,
                            spec.head_dim), spec.dtype, seed)

    def token_kv(self, state, layer, token):  # type: ignore[no-untyped-def]
        return state["kv"][layer, :, token]


def _one_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int | None) -> dict:
    """An engine whose KV is one tensor ``kv`` of ``shape``: random with ``seed``, else zeros."""
    if seed is None:
        return {"kv": torch.zeros(shape, dtype=dtype)}
    return {"kv": torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)}
