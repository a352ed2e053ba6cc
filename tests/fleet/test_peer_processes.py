"""Two processes: one instance holds KV in its memory, the other reads it
through the ``peer`` tier; the holder is killed (SIGKILL) and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmkv.fleet.rendezvous import Rendezvous
from tests.fleet.test_peer_tier import build, keys, read

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from tests.fleet.test_peer_tier import build, keys, store
a, b, salt = sys.argv[1], sys.argv[2], int(sys.argv[3])
manager = build(a, [a, b], push_to_owner=False)
store(manager, keys(32, salt=salt))
print("ready", flush=True)
sys.stdin.read()  # until the test closes it (or kills this process)
manager.close()
"""


def holder(a: str, b: str, salt: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, a, b, str(salt)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the holder stores 32 small chunks
    if line.strip() != "ready":
        proc.kill()
        pytest.fail(f"the holder did not start: {line!r}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_a_second_process_reads_the_first_ones_memory_and_survives_its_death(
        tmp_path: Path) -> None:
    a, b = f"ipc://{tmp_path}/fleet/a.sock", f"ipc://{tmp_path}/fleet/b.sock"
    ks = keys(32, salt=40)
    fleet = Rendezvous([a, b])
    from_a = [k for k in ks if fleet.owner(k) == a]
    assert len(from_a) > 4
    first = holder(a, b, 40)
    reader = build(b, [a, b])
    try:
        assert reader.contains_prefix(from_a) == len(from_a)
        assert read(reader, from_a) == [True] * len(from_a)

        first.send_signal(signal.SIGKILL)
        first.wait(30)
        start = time.monotonic()
        again = [k for k in keys(32, salt=41) if fleet.owner(k) == a]
        assert reader.contains_prefix(again) == 0
        assert reader.get(again) == []
        assert time.monotonic() - start < 3.0, "a dead peer must cost no long wait"

        second = holder(a, b, 41)  # the same address, a new process: no restart here
        try:
            deadline = time.monotonic() + 10
            while reader.contains_prefix(again) < len(again) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert read(reader, again) == [True] * len(again)
        finally:
            stop(second)
    finally:
        stop(first)
        reader.close()
