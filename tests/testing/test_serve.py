"""lmkv.testing.serve without vLLM: the /metrics parser and the clean-stop checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from lmkv.memory.shm import SharedSegment
from lmkv.testing import serve

PAGE = textwrap.dedent("""\
    # HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
    # TYPE vllm:prefix_cache_hits counter
    vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
    vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
    # TYPE vllm:lmkv_tier_usage_bytes gauge
    vllm:lmkv_tier_usage_bytes{engine="0",tier="cpu"} 100.0
    vllm:lmkv_tier_usage_bytes{engine="0",tier="fs"} 28.0
    """)


def test_parse_prometheus_sums_over_labels() -> None:
    parsed = serve.parse_prometheus(PAGE)
    assert parsed["vllm:prefix_cache_hits_total"] == 512.0
    assert parsed["vllm:lmkv_tier_usage_bytes"] == 128.0


def test_kv_transfer_config_is_the_documented_recipe() -> None:
    """What the CI's `vllm serve` runs is docs/vllm.md's first recipe, read from the
    docs: the same config with the recipe's own extra config."""
    import json
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    match = re.search(r"vllm serve /path/to/model --kv-transfer-config '(\{.*?\})'", docs,
                      re.DOTALL)
    assert match, "docs/vllm.md lost its vllm serve recipe"
    recipe = json.loads(match.group(1))
    assert serve.lmkv_kv_transfer_config(recipe["kv_connector_extra_config"]) == recipe
    config = serve.lmkv_kv_transfer_config({"lmkv.chunk_size": 256})
    assert config["kv_connector_extra_config"] == {"lmkv.chunk_size": 256}


def _python(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_clean_stop_reports_nothing() -> None:
    proc = _python("import signal, sys, time\n"
                   "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                   "print('ready', flush=True)\ntime.sleep(60)")
    assert serve.stop_process(proc, timeout_s=30) == []


@pytest.mark.slow  # processes started and stopped
def test_stop_reports_a_child_left_running_and_its_exit_code() -> None:
    proc = _python("import subprocess, sys, time\n"
                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   "print('ready', flush=True)\ntime.sleep(60)")
    tree = serve.process_tree(proc.pid)
    assert len(tree) == 2
    problems = serve.stop_process(proc, pids=tree, timeout_s=30, what="p")
    assert any("exited" in p for p in problems)
    assert any(f"left process {tree[1]}" in p for p in problems)
    deadline = time.monotonic() + 30
    while serve.alive(tree[1]) and time.monotonic() < deadline:  # the check killed it
        time.sleep(0.1)
    assert not serve.alive(tree[1])


@pytest.mark.slow  # process groups started and stopped
def test_stop_finds_an_orphan_of_its_process_group() -> None:
    # the middle process exits at once: its child is reparented, out of the tree
    proc = _python("import subprocess, sys, time\n"
                   "subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; "
                   "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"])']"
                   ").wait()\n"
                   "print('ready', flush=True)\ntime.sleep(60)")
    orphans = [p for p in serve.group_members(proc.pid) if p not in serve.process_tree(proc.pid)]
    assert len(orphans) == 1
    problems = serve.stop_process(proc, timeout_s=30, what="p")
    assert any(f"left process {orphans[0]}" in p for p in problems)


def test_lmkv_segments_names_what_a_process_created() -> None:
    segment = SharedSegment.create(4096)
    try:
        assert serve.lmkv_segments([os.getpid()]) == [segment.name]
        assert serve.lmkv_segments([os.getpid() + 1_000_000]) == []
    finally:
        segment.close()
    assert serve.lmkv_segments([os.getpid()]) == []


def test_start_error_line_names_the_root_cause() -> None:
    log = textwrap.dedent("""\
        (APIServer pid=1) WARNING 12-01 [system_utils.py:255] errors like `OSError: [Errno 24]`
        (Worker pid=3) ERROR 12-01 21:18:06 [executor.py:1063] Exception: CPU Offloading no
        RuntimeError: Engine core initialization failed. See root cause above.
        """)
    assert serve.start_error_line(log) == "Exception: CPU Offloading no"
    assert serve.start_error_line("RuntimeError: Engine core initialization failed.\nbye\n") \
        == "bye"
