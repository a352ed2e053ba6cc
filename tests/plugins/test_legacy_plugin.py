"""A plugin written for lmkv 0.1, installed beside lmkv 0.2: every class is left out
at load with one line, in every command, and nothing crashes; its port passes the
kits with every built-in eviction policy and runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmkv.contracts import OffloadContext
from lmkv.testing import EvictionPolicyConformance, StorageBackendConformance
from lmkv.testing.building import build_plugin, load_problem
from lmkv.testing.server import spawn_server
from tests.conftest import run_cli
from tests.plugins.legacy_plugin import LEGACY_CLASSES, write_legacy, write_ported
from tests.plugins.plugin_fixtures import DictFrameEdits

CPU_ONLY = "tiers:\n  - type: cpu\n    options: {max_bytes: 4MiB}\n"


@pytest.fixture
def legacy(tmp_path: Path) -> dict[str, str]:
    """The env of a process in which lmkv-legacy 0.1.0 is installed."""
    root = write_legacy(tmp_path / "site")
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(root), *([inherited] if inherited else [])])}


def plugin_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "lmkv-legacy" in line]


def assert_one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = plugin_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    line = lines[0]
    for title, name in LEGACY_CLASSES:
        assert f"{title} '{name}'" in line, line
    assert "LMKV_DISABLE_PLUGINS=lmkv-legacy" in line
    return line


@pytest.mark.slow  # lmkv commands in processes
@pytest.mark.slow  # lmkv in processes
def test_every_class_is_left_out_with_what_to_change(legacy, tmp_path: Path) -> None:
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(CPU_ONLY)
    result = run_cli("config", "check", str(cfg), env=legacy)
    assert result.returncode == 0, result.stderr
    line = assert_one_line(result)
    assert "batched_submit_put(self, keys, objs) cannot be called as " \
           "batched_submit_put(keys, objs, parents=...)" in line
    assert "constructor cannot be called as cls(options, context)" in line
    assert "serialize(self, obj) cannot be called as serialize(obj, key)" in line


@pytest.mark.slow  # lmkv commands in processes
@pytest.mark.slow  # lmkv in processes
def test_a_config_selecting_a_left_out_class_says_why(legacy, tmp_path: Path) -> None:
    cfg = tmp_path / "legacy.yaml"
    cfg.write_text("tiers:\n  - type: legacy\n    eviction: oldest-first\n")
    result = run_cli("config", "check", str(cfg), env=legacy)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmkv: error")]
    assert len(errors) == 2, result.stderr  # one per reference: the tier and its policy
    assert "tiers.0.type = 'legacy'" in errors[0] and "left out at load" in errors[0]
    assert "tiers.0.eviction.type = 'oldest-first'" in errors[1]


@pytest.mark.slow  # lmkv commands in processes
@pytest.mark.slow  # lmkv in processes
def test_stats_replay_and_plugins_go_on_without_it(legacy, tmp_path: Path) -> None:
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(CPU_ONLY)
    stats = run_cli("stats", "--config", str(cfg), "--json", env=legacy)
    assert stats.returncode == 0, stats.stderr
    assert_one_line(stats)

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024,
                                         "output_length": 1, "hash_ids": [0, 1, i % 3 + 2]})
                             + "\n" for i in range(12)))
    replay = run_cli("replay", str(trace), "--capacity", "50%", "--json", env=legacy)
    assert replay.returncode == 0, replay.stderr
    assert_one_line(replay)
    policies = {row["policy"] for row in json.loads(replay.stdout)["rows"]}
    assert {"lru", "lfu", "arc", "s3fifo"} <= policies and "oldest-first" not in policies

    listing = run_cli("plugins", "--json", env=legacy)
    assert listing.returncode == 0, listing.stderr
    errors = [e for e in json.loads(listing.stdout)["errors"]
              if e["distribution"] == "lmkv-legacy"]
    assert len(errors) == len(LEGACY_CLASSES)


@pytest.mark.slow  # a process of its own
@pytest.mark.slow  # lmkv in processes
def test_an_engine_opens_without_it(legacy) -> None:
    code = textwrap.dedent("""
        import torch
        from lmkv import KVSpec, load_config, open_engine
        config = load_config(env={}, overrides={
            "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "4MiB"}}]})
        spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
        engine = open_engine(config, spec, model_name="m")
        engine.close()
        print("opened")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, **legacy}, timeout=300)
    assert result.returncode == 0 and "opened" in result.stdout, result.stderr
    assert_one_line(result)


@pytest.mark.slow  # a real lmkv server
@pytest.mark.slow  # lmkv in processes
def test_a_server_starts_and_stops_without_it(legacy, tmp_path: Path) -> None:
    proc, _ = spawn_server(tmp_path, CPU_ONLY, env={**os.environ, **legacy})
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert "Traceback" not in log
    assert len(plugin_lines(log)) == 1, log


@pytest.mark.slow  # lmkv commands in processes
def test_the_demo_runs_without_it(legacy) -> None:
    result = run_cli("demo", "--preset", "tiny", env=legacy)
    assert result.returncode == 0, result.stderr
    assert_one_line(result)


def test_a_class_for_another_major_is_left_out_with_the_guide() -> None:
    from lmkv.contracts import API_VERSIONS, StorageBackend

    class Declared(StorageBackend):
        name = "declared"
        api_version = "1.0"

    problem = load_problem(Declared)
    ours = API_VERSIONS["storage_backend"]  # 2.x
    assert problem == (f"written for the storage backend API 1.0, this lmkv has {ours}: see "
                       "docs/migrating-plugins.md for what to change")


# -- the port passes the kits, with every built-in eviction policy -----------------
def _ported() -> dict[str, type]:
    """The ported package's classes, imported from a directory of their own."""
    import importlib
    import tempfile

    root = write_ported(Path(tempfile.mkdtemp(prefix="lmkv-ported-")))
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("lmkv_legacy.plugin")
        return {name: getattr(module, name) for name in
                ("LegacyTier", "OldestFirst", "EveryFinished", "Deflate")}
    finally:
        sys.path.remove(str(root))
        for name in ("lmkv_legacy.plugin", "lmkv_legacy"):
            sys.modules.pop(name, None)


PORTED = _ported()


class TestPortedTier(DictFrameEdits, StorageBackendConformance):
    backend_class = PORTED["LegacyTier"]
    per_process_reason = "the ported tier keeps its frames in a dict of its process"


class TestPortedPolicy(EvictionPolicyConformance):
    policy_class = PORTED["OldestFirst"]


def test_the_ported_classes_pass_the_load_check() -> None:
    for cls in PORTED.values():
        assert load_problem(cls) == "", cls


def test_the_ported_offload_policy_and_serializer_are_built_as_lmkv_builds_them() -> None:
    from lmkv.contracts import CacheKey, KeyMeta, SerializerContext
    from lmkv.memory import MemoryAllocator, tensor_obj

    policy = build_plugin(PORTED["EveryFinished"], {}, OffloadContext(threshold=1))
    assert policy.pop_items_for_offload(5) == []
    serializer = build_plugin(PORTED["Deflate"], {}, SerializerContext())
    key = CacheKey(KeyMeta("m"), bytes(32))
    data = torch.randn(2, 2, 4, 1, 8)
    frame = serializer.frame_bytes(tensor_obj(data), key)
    arena = MemoryAllocator(1 << 20, pin_memory=False)
    obj = serializer.deserialize(frame, arena.allocate, key)
    assert torch.equal(obj.tensor, data)
    obj.ref_down()
