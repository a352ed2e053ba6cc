"""Two engine processes, each with its own cpu tier, share KV through one
Mooncake pool (``open_local_engine``, the tier found through its entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from mooncake_engine_worker import TOKENS, hf_kv
from mooncake_servers import MooncakeMaster

WORKER = Path(__file__).with_name("mooncake_engine_worker.py")


def run_worker(mode: str, options: dict, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), mode, json.dumps(options), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def shared_between_processes(options: dict, tmp_path: Path) -> None:
    """A worker stores 8 chunks through a tier of ``options``, a second one, started
    after the first exited, retrieves all 8 from the pool, each its own."""
    stored = run_worker("store", options, tmp_path / "a.json")
    assert stored["lookup_before"] == 0 and stored["stored"] == 256 and stored["flushed"]
    assert stored["tiers"][1]["puts"] == 8

    got = run_worker("retrieve", options, tmp_path / "b.json")
    assert got["lookup_before"] == 256  # its own cpu tier is empty: the hits are the pool's
    assert got["retrieved"] == 256
    cpu, remote = got["tiers"]
    assert cpu["hits"] == 0 and remote["hits"] == 8 and remote["corrupt_frames"] == 0
    expected = hf_kv(len(TOKENS))
    retrieved = torch.load(tmp_path / "b.json.kv")
    for (k, v), (rk, rv) in zip(expected, retrieved, strict=True):
        assert torch.equal(rk[0], k[0, :, :256]) and torch.equal(rv[0], v[0, :, :256])


def test_kv_stored_by_one_process_is_retrieved_by_another(
        mooncake_master: MooncakeMaster, shared_client: None, tmp_path: Path) -> None:
    # shared_client: this process holds the pool's memory (one 64 MiB segment).
    shared_between_processes(mooncake_master.options(key_prefix="procs:", global_segment_size=0),
                             tmp_path)
