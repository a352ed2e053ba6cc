"""``lmkv migrate`` through the real CLI: an LMCache config file and LMCACHE_* variables
become an lmkv config that lmkv loads, with a stderr line per option left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmkv.config.model import load_config
from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # the lmkv command in a process

LMCACHE_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 0.0625
local_disk: "file://{disk}/"
max_local_disk_size: 2
enable_blending: true
save_unfull_chunk: true
"""


def migrate(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``python -m lmkv migrate ARGS`` with no LMCACHE_* variable but ``env``'s."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("LMKV_", "LMCACHE_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "lmkv", "migrate", *args],
                          capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300)


def test_file_and_env_become_an_lmkv_config_that_loads(tmp_path: Path) -> None:
    source = tmp_path / "lmcache.yaml"
    source.write_text(LMCACHE_YAML.format(disk=tmp_path / "disk"))
    proc = migrate(str(source), env={"LMCACHE_CHUNK_SIZE": "512",
                                     "LMCACHE_ENABLE_ASYNC_LOADING": "true"})
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["chunk_size"] == 512  # the variable wins over the file, as in LMCache
    assert data["async_load"] is True
    assert data["tiers"] == [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        {"type": "fs", "options": {"url": f"{tmp_path / 'disk'}/", "max_bytes": "2GiB"}}]
    out = tmp_path / "lmkv.yaml"
    out.write_text(proc.stdout)
    config = load_config(out, env={})
    assert (config.chunk_size, [t.type for t in config.tiers]) == (512, ["cpu", "fs"])
    check = run_cli("config", "check", str(out))
    assert check.returncode == 0, check.stderr


def test_each_option_left_behind_is_one_stderr_line_naming_it(tmp_path: Path) -> None:
    source = tmp_path / "lmcache.yaml"
    source.write_text(LMCACHE_YAML.format(disk=tmp_path / "disk"))
    proc = migrate(str(source), env={"LMCACHE_ENABLE_PD": "true",
                                     "LMCACHE_LOG_LEVEL": "DEBUG"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [
        f"lmkv migrate: not carried: 'enable_blending' (from {source}): lmkv reuses "
        "prefixes only (no CacheBlend)",
        "lmkv migrate: not carried: LMCACHE_ENABLE_PD: disaggregated prefill is a "
        "transport, not a cache: use vLLM's NixlConnector",
        "lmkv migrate: not carried: LMCACHE_LOG_LEVEL: set LMKV_LOG_LEVEL (or lmkv "
        "--log-level) instead"]
    assert "blending" not in proc.stdout and "save_unfull" not in proc.stdout


def test_env_alone_without_a_file(tmp_path: Path) -> None:
    proc = migrate(env={"LMCACHE_CHUNK_SIZE": "128", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
                        "LMCACHE_REMOTE_URL": "lm://cache:65432"})
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == {
        "chunk_size": 128, "tiers": [{"type": "cpu", "options": {"max_bytes": "512MiB"}}]}
    assert proc.stderr.startswith("lmkv migrate: not carried: LMCACHE_REMOTE_URL: ")
    assert "lmkv server" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_lmcache_config_file_variable_names_the_file(tmp_path: Path) -> None:
    source = tmp_path / "lmcache.yaml"
    source.write_text("chunk_size: 64\nmax_local_cpu_size: 0.0625\n")
    proc = migrate(env={"LMCACHE_CONFIG_FILE": str(source)})
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["chunk_size"] == 64
    assert proc.stderr == ""


def test_a_value_of_the_wrong_type_is_one_line(tmp_path: Path) -> None:
    proc = migrate(env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "lots"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("lmkv: error: LMCache option LMCACHE_MAX_LOCAL_CPU_SIZE = "
                           "'lots': must be a number of GB (e.g. 5 or 2.5)\n")


def test_a_mooncakestore_remote_becomes_a_mooncake_tier_that_loads(tmp_path: Path) -> None:
    source = tmp_path / "lmcache.yaml"
    source.write_text("remote_url: mooncakestore://127.0.0.1:50051/\n"
                      "extra_config:\n"
                      "  metadata_server: http://127.0.0.1:8080/metadata\n"
                      "  local_hostname: 127.0.0.1\n"
                      "  protocol: tcp\n"
                      "  global_segment_size: 268435456\n"
                      "  storage_root_dir: /ssd/mooncake\n")
    proc = migrate(str(source))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["tiers"][1] == {"type": "mooncake", "options": {
        "master_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata",
        "local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": "256MiB",
        "local_buffer_size": "1GiB"}}
    assert proc.stderr.splitlines() == [
        f"lmkv migrate: not carried: 'extra_config' (from {source}) key 'storage_root_dir': "
        "lmkv's mooncake tier keeps no entries on Mooncake's SSD offload"]
    out = tmp_path / "lmkv.yaml"
    out.write_text(proc.stdout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMKV_", "MOONCAKE_"))}
    check = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(out)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert check.returncode == 0, check.stderr
