"""Two engine processes, each with its own cpu tier, share KV through one tier
below it: ``shared_between_processes`` runs this module twice, one process
after the other::

    python -m lmkv.testing.engine_worker store|retrieve TIER_FILE OUT_FILE

``TIER_FILE`` (JSON, owner-only: it may hold credentials) is the shared
tier's ``{"type", "options"}``. ``store`` stores 8 chunks and a tail of a
prompt and flushes them to the tier; ``retrieve`` (a fresh process, its cpu
tier empty) looks the prompt up and retrieves it. Each writes a JSON report
(and ``retrieve`` the KV it got, ``OUT_FILE.kv``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lmkv.contracts.connector import KVSpec
from lmkv.testing.engines import open_local_engine
from lmkv.testing.tiers import load_test_config

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32
TOKENS = list(range(1000, 1000 + 8 * CHUNK + 5))  # 8 whole chunks and a tail
#: One worker's whole life, torch's import included (a liveness bound).
WORKER_TIMEOUT_S = 180.0


def hf_kv(total: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, total, 16, generator=gen).half(),
             torch.randn(1, 2, total, 16, generator=gen).half()) for _ in range(2)]


def main(mode: str, tier_file: str, out: str) -> None:
    with open(tier_file, encoding="utf-8") as f:
        tier = json.load(f)
    config = load_test_config({
        "lmkv.chunk_size": CHUNK,
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": 8 << 20}}, tier]})
    with open_local_engine(config, SPEC, model_name="two-processes") as engine:
        report: dict[str, Any] = {"lookup_before": engine.lookup(TOKENS)}
        if mode == "store":
            report["stored"] = engine.store(TOKENS, kv=hf_kv(len(TOKENS)))
            report["flushed"] = engine.storage.flush(30)
        else:
            result = engine.retrieve(TOKENS)
            report["retrieved"] = result.num_tokens
            torch.save(result.kv, out + ".kv")
        report["tiers"] = engine.stats()
    with open(out, "w") as f:
        json.dump(report, f)


def run_worker(mode: str, tier_file: Path, out: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "lmkv.testing.engine_worker", mode,
                           str(tier_file), str(out)], capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def shared_between_processes(tier: dict[str, Any], directory: Path) -> None:
    """A worker stores 8 chunks through ``tier`` below its cpu tier; a second one,
    started after the first exited, retrieves all 8 from ``tier``, each its own."""
    tier_file = directory / "shared-tier.json"
    with os.fdopen(os.open(tier_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(tier, f)
    stored = run_worker("store", tier_file, directory / "a.json")
    assert stored["lookup_before"] == 0 and stored["stored"] == 256 and stored["flushed"]
    assert stored["tiers"][1]["puts"] == 8

    got = run_worker("retrieve", tier_file, directory / "b.json")
    assert got["lookup_before"] == 256  # its own cpu tier is empty: the hits are the tier's
    assert got["retrieved"] == 256
    cpu, shared = got["tiers"]
    assert cpu["hits"] == 0 and shared["hits"] == 8 and shared["corrupt_frames"] == 0
    expected = hf_kv(len(TOKENS))
    retrieved = torch.load(directory / "b.json.kv")
    for (k, v), (rk, rv) in zip(expected, retrieved, strict=True):
        assert torch.equal(rk[0], k[0, :, :256]) and torch.equal(rv[0], v[0, :, :256])


if __name__ == "__main__":
    main(*sys.argv[1:])
