"""Two engine processes, each with its own cpu tier, share KV through one Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from redis_engine_worker import TOKENS, hf_kv
from redis_servers import RedisServer

WORKER = Path(__file__).with_name("redis_engine_worker.py")


def run_worker(mode: str, server: RedisServer, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), mode, server.url, "procs:", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_kv_stored_by_one_process_is_retrieved_by_another(redis_server: RedisServer,
                                                          tmp_path: Path) -> None:
    stored = run_worker("store", redis_server, tmp_path / "a.json")
    assert stored["lookup_before"] == 0 and stored["stored"] == 256 and stored["flushed"]
    assert stored["tiers"][1]["puts"] == 8

    got = run_worker("retrieve", redis_server, tmp_path / "b.json")
    assert got["lookup_before"] == 256  # its own cpu tier is empty: the hits are Redis's
    assert got["retrieved"] == 256
    cpu, remote = got["tiers"]
    assert cpu["hits"] == 0 and remote["hits"] == 8 and remote["corrupt_frames"] == 0
    expected = hf_kv(len(TOKENS))
    retrieved = torch.load(tmp_path / "b.json.kv")
    for (k, v), (rk, rv) in zip(expected, retrieved, strict=True):
        assert torch.equal(rk[0], k[0, :, :256]) and torch.equal(rv[0], v[0, :, :256])
