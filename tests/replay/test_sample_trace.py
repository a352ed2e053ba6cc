"""The sample trace docs/replay.md uses ships in the repository, is what its
generator writes, and replays with hits through the real ``lmkv replay``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # lmkv replay over a 300-request trace

TRACE = REPO / "benchmarks" / "traces" / "sample_trace.jsonl"
SCRIPT = REPO / "benchmarks" / "make_sample_trace.py"


def test_the_committed_trace_is_what_its_script_writes(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_sample_trace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path / "trace.jsonl")
    assert (tmp_path / "trace.jsonl").read_bytes() == TRACE.read_bytes()
    records = [json.loads(line) for line in TRACE.read_text().splitlines()]
    assert len(records) == 300
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
               for r in records)


def test_replay_of_the_sample_trace_shows_prefix_hits() -> None:
    done = run_cli("replay", str(TRACE), "--capacity", "10%,100%", "--policies", "lru",
                   "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["format"], out["requests"]) == ("mooncake", 300)
    small, full = out["rows"]
    # Everything fits at 100%: every chunk but its first sighting is a hit, as for Belady.
    assert full["hits"] == full["belady_hits"] == out["chunk_requests"] - out["unique_chunks"]
    assert full["hit_ratio"] > 0.5
    assert 0 < small["hit_ratio"] <= small["belady_hit_ratio"] < full["hit_ratio"]


def test_docs_replay_uses_the_sample_trace_and_names_the_public_ones() -> None:
    page = (REPO / "docs" / "replay.md").read_text()
    assert "benchmarks/traces/sample_trace.jsonl" in page
    assert "kvcache-ai/Mooncake" in page
    assert "shared/traces" not in page  # a path on one machine, not in the repository
