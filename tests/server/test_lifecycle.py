"""The server's life: graceful shutdown flushes lower tiers and unlinks its segment;
a SIGKILL leaves no segment; clients ride through a kill and a restart."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.plugins.plugin_fixtures import write_dist
from tests.server.procs import (
    REPO,
    child_env,
    chunk_for,
    free_port,
    lmkv_segments,
    prompt_keys,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow  # real lmkv server processes

SLOW_TIER = '''
import time

from lmkv.plugins import hookimpl
from lmkv_backends.tiers.cpu import CPUBackend, CPUOptions


class SlowOptions(CPUOptions):
    put_delay_s: float = 0.4


class SlowCPU(CPUBackend):
    """A lower tier whose every put takes a while (a far disk)."""

    name = "slow-cpu"
    Options = SlowOptions

    def batched_submit_put(self, keys, objs, parents=None):
        time.sleep(self.options.put_delay_s)
        return super().batched_submit_put(keys, objs)


@hookimpl
def lmkv_storage_backends():
    return [SlowCPU]
'''

TWO_TIERS = """
tiers:
  - type: cpu
    options: {max_bytes: 64MiB}
  - type: slow-cpu
    options: {max_bytes: 64MiB, put_delay_s: 0.4}
"""


def test_sigterm_flushes_queued_lower_tier_stores_and_unlinks_the_segment(tmp_path) -> None:
    plugin_root = write_dist(tmp_path / "plugins", "lmkv-slow", "lmkv_slow", SLOW_TIER)
    srv = start_server(tmp_path, TWO_TIERS, extra_path=plugin_root)
    assert srv.shm_name in lmkv_segments()
    prompts = [prompt_keys(400 + i, chunks=1) for i in range(8)]
    with srv.client() as client:
        for keys in prompts:  # one write-through item each: 8 x 0.4 s on the lower tier
            assert client.store(keys, [chunk_for(keys[0])]) == 1
        queued = client.stats().tiers[1]["write_queue_chunks"]
    assert queued >= 4  # most of them are still queued when the signal comes
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    upper, lower = srv.final_tier_stats()
    assert upper["puts"] == 8
    assert lower["puts"] == 8 and lower["dropped_writes"] == 0
    assert "flushed" in srv.log()
    assert srv.shm_name not in lmkv_segments()


def test_drain_timeout_0_stops_without_waiting_for_queued_stores(tmp_path) -> None:
    plugin_root = write_dist(tmp_path / "plugins", "lmkv-slow", "lmkv_slow", SLOW_TIER)
    srv = start_server(tmp_path, TWO_TIERS, "--drain-timeout", "0", extra_path=plugin_root)
    with srv.client() as client:
        for i in range(8):
            keys = prompt_keys(500 + i, chunks=1)
            assert client.store(keys, [chunk_for(keys[0])]) == 1
        assert client.stats().tiers[1]["write_queue_chunks"] >= 4
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert "--drain-timeout 0: not waiting for" in srv.log()
    assert "flushed" not in srv.log() and "Traceback" not in srv.log()
    assert srv.shm_name not in lmkv_segments()


def test_sigint_stops_the_server_cleanly(tmp_path) -> None:
    srv = start_server(tmp_path)
    assert srv.stop(signal.SIGINT) == 0
    assert "SIGINT received" in srv.log() and "Traceback" not in srv.log()
    assert srv.shm_name not in lmkv_segments()


def start_worker(srv, tmp: Path, worker: int, data_path: str, stop: Path) -> tuple:
    out = tmp / f"worker-{worker}.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.worker", "loop", srv.address, data_path,
         str(worker), str(out), str(stop), "100000", "300"],
        env=child_env(), cwd=REPO, stderr=subprocess.PIPE, text=True)
    return proc, out


def records(out: Path) -> list[dict]:
    if not out.exists():
        return []
    lines = out.read_text().splitlines()
    return [json.loads(ln) for ln in lines if ln.endswith("}")]


def test_clients_recover_by_themselves_after_a_sigkill_and_restart(tmp_path) -> None:
    port = free_port()
    srv = start_server(tmp_path, None, port=port, name="first")
    stop = tmp_path / "stop"
    workers = [start_worker(srv, tmp_path, i, t, stop) for i, t in enumerate(["auto", "inline"])]
    try:
        # Both engines are running and hitting.
        assert wait_for(lambda: all(sum(r.get("got", 0) for r in records(out)) > 0
                                    for _, out in workers), timeout_s=30)
        assert records(workers[0][1])[-1]["shm"] and not records(workers[1][1])[-1]["shm"]
        killed_at = time.time()
        srv.stop(signal.SIGKILL)
        # The killed server's resource tracker unlinks its segment.
        assert wait_for(lambda: srv.shm_name not in lmkv_segments(), timeout_s=10)
        time.sleep(1.5)  # the engines go on, missing
        restarting_at = time.time()
        srv = start_server(tmp_path, None, port=port, name="second")
        restarted_at = time.time()

        def hits_after_restart(out: Path) -> bool:
            return any(r.get("got", 0) > 0 and r["t"] > restarted_at for r in records(out))

        assert wait_for(lambda: all(hits_after_restart(out) for _, out in workers),
                        timeout_s=30), [records(out)[-3:] for _, out in workers]
    finally:
        stop.touch()
        codes = [proc.wait(30) for proc, _ in workers]
        assert srv.stop() == 0
    errors = [proc.stderr.read() for proc, _ in workers]
    assert codes == [0, 0], errors  # no exception reached the engine
    for _, out in workers:
        rows = records(out)
        summary = rows[-1]
        assert summary["summary"] and summary["mismatches"] == 0
        # An iteration that read before the kill may log just after it.
        down = [r for r in rows[:-1] if killed_at + 1.0 < r["t"] < restarting_at]
        assert down and all(r["got"] == 0 for r in down)  # misses while no server
        counters = summary["counters"]
        assert counters["unreachable"] + counters["timeouts"] > 0
    assert records(workers[0][1])[-2]["shm"]  # remapped the new server's segment
    assert srv.shm_name not in lmkv_segments()
