"""Start-up against a master that does not answer: bounded by
``connect_timeout_s``, one line, misses, and the tier connects by itself once
a master answers there. Mooncake's own ``setup`` holds the GIL while it
retries (about 90 s a call): the process must never wait on it.

The bounds below are liveness bounds (the stall they catch is minutes long),
never timings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_mooncake_faults import chunk, eventually, key, put, read

from lmkv.testing.mooncake import MooncakeMaster, require_mooncake
from lmkv.testing.server import spawn_server

pytestmark = pytest.mark.slow  # a real mooncake_master

#: Mooncake's own log lines (glog: I1204 18:52:54.197 ...).
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d")


def _silent_master(tmp_path: Path) -> MooncakeMaster:
    """A master's ports, nobody listening on them (yet)."""
    require_mooncake()
    return MooncakeMaster(tmp_path / "master")


def _config(tmp_path: Path, master: MooncakeMaster, **extra: object) -> Path:
    options = {**master.options(global_segment_size=0, connect_timeout_s=1), **extra}
    flow = ", ".join(f"{k}: '{v}'" for k, v in options.items())
    path = tmp_path / "lmkv.yaml"
    path.write_text(f"tiers: [{{type: cpu, options: {{max_bytes: 8MiB}}}}, "
                    f"{{type: mooncake, options: {{{flow}}}}}]\n")
    return path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("LMKV_", "MOONCAKE_"))}


def test_a_silent_master_at_start_is_one_line_then_misses_then_recovery(
        tmp_path: Path, make_tier: object) -> None:
    master = _silent_master(tmp_path)
    started = time.monotonic()
    tier = make_tier(master, connect_timeout_s=0.5)
    assert time.monotonic() - started < 30, "start-up waited on Mooncake's setup"
    assert tier.batched_async_contains("l", [key(1)]) == 0
    assert read(tier, 1) is None
    assert put(tier, [1]) == 0
    master.start()
    try:
        assert eventually(lambda: put(tier, [2]) == 1), "the tier did not connect"
        assert torch.equal(read(tier, 2), chunk(2))
    finally:
        master.stop()


def test_lmkv_stats_against_a_silent_master_prints_one_line_for_the_tier(
        tmp_path: Path) -> None:
    """The real CLI, in its own process: what it writes to stderr is everything
    (Mooncake's logging goes to file descriptor 2 behind Python's back)."""
    master = _silent_master(tmp_path)
    config = _config(tmp_path, master)
    with config.open("a") as f:  # where no server answers: stats opens the tiers itself
        f.write("server: {address: 'tcp://127.0.0.1:1'}\n")
    started = time.monotonic()
    # No --server: an address given on the command line is the server asked for (an
    # error when none answers); the config's address falls back to opening the tiers.
    done = subprocess.run([sys.executable, "-m", "lmkv", "stats", "--config", str(config)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert time.monotonic() - started < 60, "lmkv stats waited on Mooncake's setup"
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    (tier_line,) = [line for line in lines if "mooncake" in line.lower()]
    assert tier_line.endswith(f"lmkv mooncake tier: master {master.address} does not answer "
                              "after 1s (connect_timeout_s); answering misses until it does")
    assert not [line for line in lines if GLOG_LINE.match(line)], lines
    assert len(lines) == 2, lines  # and lmkv stats' own "no lmkv server answers" line
    assert "tier 1 (mooncake)" in done.stdout


def test_lmkv_server_against_a_silent_master_listens_and_stops_on_sigterm(
        tmp_path: Path) -> None:
    master = _silent_master(tmp_path)
    config = _config(tmp_path, master)
    proc, _ = spawn_server(tmp_path, config.read_text(), env=_env(), timeout_s=60,
                           args=["--drain-timeout", "5"])
    try:
        master.start()  # connects meanwhile: the setup thread must not hold SIGTERM up
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        master.stop()
