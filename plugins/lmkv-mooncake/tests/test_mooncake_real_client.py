"""The real-client suite (``real_client_suite.py``), run by pytest in a process
of its own: its tiers are thin clients of a ``mooncake_client``, and this
process's are embedded ones, which Mooncake 0.3.13 cannot mix in one process
(it aborts; the tier refuses, as the last test here shows)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmkv.contracts import BackendContext, ConfigError
from lmkv.testing.mooncake import MooncakeMaster, require_mooncake
from lmkv.testing.tiers import serializer

pytestmark = pytest.mark.slow  # a real mooncake_master

SUITE = Path(__file__).with_name("real_client_suite.py")


def test_the_real_client_suite_passes_in_a_process_of_its_own() -> None:
    require_mooncake()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(SUITE)], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parents[3])
    # Mooncake's own log lines (glog) go to stderr; pytest's report to stdout.
    assert done.returncode == 0, done.stdout[-6000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20, done.stdout[-3000:]
    assert "failed" not in done.stdout and "error" not in done.stdout.lower(), done.stdout


def test_a_thin_tier_in_a_process_with_an_embedded_client_is_one_line(
        mooncake_master: MooncakeMaster, shared_client: None) -> None:
    # shared_client: this process has an embedded Mooncake client.
    from lmkv_mooncake import MooncakeBackend, MooncakeOptions

    with pytest.raises(ConfigError) as refused:
        MooncakeBackend(MooncakeOptions(client_address="127.0.0.1:1"),
                        BackendContext(serializer=serializer("naive"), tier_index=1))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("config key 'tiers.1.options.client_address': ")
    assert "cannot share a process" in message
