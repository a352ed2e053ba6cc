"""plugins.md is documentation that runs: every example executes, every hook and
ABC has its section, and the tutorial backend passes the conformance suite."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from lmkv.contracts import hooks as hookspecs
from lmkv.contracts.tier import BackendContext
from lmkv.memory import MemoryAllocator
from lmkv.plugins.registry import KINDS
from lmkv.testing import StorageBackendConformance
from lmkv_backends.serde.naive import NaiveSerializer
from tests.plugins.plugin_fixtures import DictFrameEdits

DOC = (Path(__file__).resolve().parents[1] / "plugins.md").read_text()


def sections() -> dict[str, list[str]]:
    """Python code blocks under each ``### heading`` (backticks stripped)."""
    out: dict[str, list[str]] = {}
    for part in re.split(r"^### ", DOC, flags=re.M)[1:]:
        title = part.splitlines()[0].strip().strip("`")
        out[title] = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return out


SECTIONS = sections()


def run_section(title: str) -> dict:
    """Run a section's examples as the body of a fresh module (as a user's file would)."""
    module = types.ModuleType("plugins_md_" + re.sub(r"\W", "_", title))
    sys.modules[module.__name__] = module  # dataclasses look their module up
    for block in SECTIONS[title]:
        exec(compile(block, f"plugins.md:{title}", "exec"), module.__dict__)
    return module.__dict__


def test_examples_import_lmkv_only_from_the_contracts_and_testing() -> None:
    """A plugin needs nothing of lmkv beyond ``lmkv.contracts`` (and ``lmkv.testing``
    in its tests): the examples show it."""
    allowed = ("lmkv.contracts", "lmkv.testing")
    for title, blocks in SECTIONS.items():
        for block in blocks:
            for line in block.splitlines():
                m = re.match(r"\s*(?:from|import)\s+(lmkv[\w.]*)", line)
                if m and m.group(1) != "lmkv_hello" and not m.group(1).startswith(allowed):
                    raise AssertionError(f"plugins.md, {title}: {line.strip()}")


def test_every_hook_has_a_section_with_an_example() -> None:
    hooks = [name for name in dir(hookspecs) if name.startswith("lmkv_")]
    assert sorted(hooks) == sorted(k.hook for k in KINDS.values())
    for hook in hooks:
        assert SECTIONS.get(hook), f"plugins.md has no example for {hook}"


def test_the_tutorial_has_its_steps() -> None:
    assert len(SECTIONS["Tutorial: write a storage backend"]) >= 4


def test_every_abc_has_a_section_with_an_example() -> None:
    for kind in KINDS.values():
        name = kind.base_class().__name__
        assert SECTIONS.get(name), f"plugins.md has no example for {name}"


@pytest.mark.parametrize("title", [t for t, blocks in SECTIONS.items() if blocks])
def test_example_runs(title: str) -> None:
    run_section(title)


DictBackend = run_section("Tutorial: write a storage backend")["DictBackend"]


class TestTutorialBackendConformance(DictFrameEdits, StorageBackendConformance):
    backend_class = DictBackend
    per_process_reason = "the tutorial's tier is a dict in its process"


def test_tutorial_backend_turns_a_corrupt_frame_into_a_removed_miss() -> None:
    import torch

    from lmkv.keys.chunking import CacheKey, KeyMeta
    from lmkv.memory import tensor_obj

    arena = MemoryAllocator(1 << 20)
    backend = DictBackend(DictBackend.Options(),
                          BackendContext(serializer=NaiveSerializer(), allocate=arena.allocate))
    key = CacheKey(KeyMeta("m"), b"\x02" * 32)
    backend.batched_submit_put([key], [tensor_obj(torch.ones(2, 2, 4, 2, 8))]).result()
    frame = bytearray(backend.frames[key])
    frame[-1] ^= 0xFF
    backend.frames[key] = bytes(frame)
    assert backend.get_blocking(key) is None
    assert not backend.contains(key)
    assert backend.stats()["corrupt_frames"] == 1
    assert arena.live_objects == 0
