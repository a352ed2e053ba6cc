"""``lmkv config check``: valid whatever this moment's free memory, with what will not
work here now said in one warning line on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # lmkv commands in processes


def test_a_cpu_tier_larger_than_memory_is_a_warning_not_an_error(tmp_path: Path) -> None:
    config = tmp_path / "big.yaml"
    config.write_text("tiers:\n  - type: cpu\n    options: {max_bytes: 1PiB}\n")
    done = run_cli("config", "check", str(config))
    assert done.returncode == 0, done.stderr
    [warning] = done.stderr.splitlines()
    assert warning.startswith(
        f"lmkv config check: warning: config key 'tiers.0.options.max_bytes' (from {config}): "
        "1.0PiB is more than the memory this machine has available (")
    assert warning.endswith("the tier will not start here: lower it, or set "
                            "allow_overcommit: true")
    assert done.stdout.startswith(
        f"# {config}: valid, every plugin it names built (dry run); resolved configuration:\n")
    assert yaml.safe_load(done.stdout)["tiers"][0]["options"]["max_bytes"] == 1 << 50


def test_a_budget_that_fits_gets_no_warning(tmp_path: Path) -> None:
    config = tmp_path / "small.yaml"
    config.write_text("tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n")
    done = run_cli("config", "check", str(config))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
