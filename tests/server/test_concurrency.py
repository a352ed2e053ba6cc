"""Several engine processes store and retrieve through one server at the same time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.procs import REPO, child_env, chunk_for, prompt_keys, same_bytes
from tests.server.worker import SHARED_PROMPTS

pytestmark = pytest.mark.slow  # real lmkv server processes

ITERATIONS = 40


def test_concurrent_engines_get_byte_identical_chunks(server, tmp_path) -> None:
    data_paths = ["auto", "inline", "auto"]
    never = tmp_path / "never-created"
    procs = []
    for worker, data_path in enumerate(data_paths):
        out = tmp_path / f"w{worker}.jsonl"
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "tests.server.worker", "loop", server.address, data_path,
             str(worker), str(out), str(never), str(ITERATIONS), "5000"],
            env=child_env(), cwd=REPO, stderr=subprocess.PIPE, text=True), out))
    results = []
    for proc, out in procs:
        assert proc.wait(120) == 0, proc.stderr.read()
        results.append([json.loads(ln) for ln in out.read_text().splitlines()])
    for rows in results:
        summary = rows[-1]
        assert summary["mismatches"] == 0
        assert len(rows) == ITERATIONS + 1
        assert sum(r["got"] for r in rows[:-1]) > 0  # they hit, not just store
        counters = summary["counters"]
        assert counters["dropped_chunks"] == counters["error_replies"] == 0
        assert counters["timeouts"] == counters["unreachable"] == 0
    # Everything any of them stored reads back intact, through either data path.
    prompts = {r["prompt"] for rows in results for r in rows[:-1]}
    assert set(SHARED_PROMPTS) <= prompts
    for data_path in ("auto", "inline"):
        with server.client(data_path=data_path) as client:
            for prompt in sorted(prompts):
                keys = prompt_keys(prompt)
                got = client.retrieve(keys)
                assert len(got) == len(keys), prompt
                assert all(same_bytes(t, chunk_for(k)) for t, k in zip(got, keys, strict=True))
            assert client.stats().server.held_lookups == 0
