"""lmkv finds the tier through the `lmkv` entry point, and only there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmkv.contracts import ConfigError
from lmkv.testing.plugins import builtins_only, fresh_plugin_manager
from lmkv.testing.tiers import load_test_config
from lmkv_redis import RedisBackend

pytestmark = pytest.mark.slow  # a real redis-server


def lmkv_cli(*args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "lmkv", *args], capture_output=True,
                          text=True, env=full_env, timeout=120)


def test_registered_through_the_entry_point() -> None:
    with fresh_plugin_manager() as manager:  # the installed entry points, loaded afresh
        assert manager.storage_backend("redis") is RedisBackend
        entry = next(e for e in manager.registry.entries() if e.name == "redis")
    assert entry.source.distribution == "lmkv-redis" and entry.source.plugin == "lmkv-redis"


def test_lmkv_plugins_lists_it() -> None:
    out = lmkv_cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    plugins = json.loads(out.stdout)["plugins"]
    assert {"kind": "storage_backend", "name": "redis", "distribution": "lmkv-redis",
            "entry_point": "lmkv-redis"}.items() <= next(
        p for p in plugins if p["name"] == "redis").items()


def test_a_config_selects_it() -> None:
    config = load_test_config({"lmkv.tiers.1.type": "redis",
                                            "lmkv.tiers.1.options.key_prefix": "x:"})
    assert config.resolved_dump()["tiers"][1]["options"]["key_prefix"] == "x:"


def test_disabled_the_error_names_the_distribution(tmp_path: Path) -> None:
    config = tmp_path / "lmkv.yaml"
    config.write_text("tiers:\n  - type: cpu\n  - type: redis\n")
    env = {"LMKV_DISABLE_PLUGINS": "lmkv-redis"}
    out = lmkv_cli("config", "check", str(config), env=env)
    assert out.returncode != 0
    assert "unknown storage backend 'redis'" in out.stderr and "lmkv-redis" in out.stderr
    plugins = lmkv_cli("plugins", "--json", env=env)
    assert "redis" not in [p["name"] for p in json.loads(plugins.stdout)["plugins"]]


def test_not_installed_the_error_says_pip_install() -> None:
    # lmkv's built-ins only, as without lmkv-redis installed
    with builtins_only(), pytest.raises(ConfigError) as err:
        load_test_config({"lmkv.tiers.1.type": "redis"})
    assert "'redis' is provided by lmkv-redis: pip install lmkv-redis" in str(err.value)


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.1\.options\.hostname"):
        load_test_config({"lmkv.tiers.1": {"type": "redis",
                                                        "options": {"hostname": "x"}}})
