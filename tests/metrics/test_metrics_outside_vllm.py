"""Metrics outside vLLM: ``lmkv server --metrics-port`` (a real server process) and
``metrics.port`` in a process that opens an engine; ``lmkv stats`` reading both."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lmkv import KVSpec, load_config
from lmkv.engines import open_engine
from lmkv.metrics import recorder
from lmkv.metrics.exporter import serve_metrics
from lmkv.testing.engines import open_local_engine
from lmkv.testing.server import spawn_server

pytestmark = pytest.mark.slow  # lmkv server and lmkv stats processes

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32
TOKEN_BYTES = SPEC.chunk_nbytes(1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hf_kv(total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, total, 16, generator=gen).half(),
             torch.randn(1, 2, total, 16, generator=gen).half()) for _ in range(2)]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lmkv_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "lmkv", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_metrics_port_serves_what_the_local_engine_records() -> None:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK, "lmkv.metrics.port": 0})
    with open_local_engine(config, SPEC, model_name="metrics-test") as engine:
        url = serve_metrics(0).url  # the one the engine started (once per process)
        with open_engine(config, SPEC, model_name="metrics-test") as again:
            assert serve_metrics(0) is serve_metrics(0)  # a second engine: still one
            again.lookup([1])
        before = scrape(url)
        tokens = list(range(100))
        assert engine.store(tokens, kv=hf_kv(100)) == 96
        assert engine.lookup(tokens) == 96
        assert engine.retrieve(tokens).num_tokens == 96
        after = scrape(url)

    def grew(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0)

    assert grew("lmkv_stores_total") == 1
    assert grew("lmkv_stored_tokens_total") == 96
    assert grew("lmkv_store_bytes_total") == 96 * TOKEN_BYTES
    assert grew("lmkv_lookups_total") == 1
    assert grew("lmkv_lookup_hit_tokens_total") == 96
    assert grew("lmkv_lookup_miss_tokens_total") == 4
    assert grew("lmkv_loads_total") == 1
    assert grew("lmkv_loaded_tokens_total") == 96
    assert grew("lmkv_load_seconds_count") == 1
    # its tiers are a tier source (read at most once a second: the capacity is constant)
    assert any(k[0] == "lmkv_tier_capacity_bytes" and v > 0 for k, v in after.items())


def test_lmkv_stats_watch_reads_an_endpoint_again_until_ctrl_c() -> None:
    url = serve_metrics(0).url  # this process's endpoint, read from another process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "lmkv", "stats", "--server", url,
                             "--watch", "0.1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        readings = 0
        for line in proc.stdout:  # type: ignore[union-attr]
            readings += line.startswith("lookups ")
            if readings == 3:
                break
        assert readings == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_opened_for_vllm_records_nothing() -> None:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK})
    before = recorder().totals().counters
    with open_local_engine(config, SPEC, model_name="quiet", record_metrics=False) as engine:
        engine.store(list(range(64)), kv=hf_kv(64))
        engine.lookup(list(range(64)))
        engine.retrieve(list(range(64)))
    assert recorder().totals().counters == before


def test_lmkv_server_metrics_port_and_lmkv_stats(tmp_path) -> None:
    port = free_port()
    proc, address = spawn_server(tmp_path, "tiers: [{type: cpu, options: {max_bytes: 16MiB}}]\n",
                                 args=["--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        config = load_config(env={}, overrides={
            "lmkv.mode": "server", "lmkv.chunk_size": CHUNK, "lmkv.server.address": address,
            "lmkv.server.timeout_ms": 5000})
        tokens = list(range(100))
        with open_engine(config, SPEC, model_name="server-metrics") as engine:
            assert engine.store(tokens, kv=hf_kv(100)) == 96
            assert engine.lookup(tokens) == 96
            assert engine.retrieve(tokens).num_tokens == 96
        got = scrape(url)
        assert got[("lmkv_stores_total", ())] >= 1
        assert got[("lmkv_stored_tokens_total", ())] == 96
        assert got[("lmkv_store_bytes_total", ())] == 96 * TOKEN_BYTES
        assert got[("lmkv_lookup_hit_tokens_total", ())] >= 96
        assert got[("lmkv_loaded_tokens_total", ())] == 96
        assert got[("lmkv_lookup_seconds_count", ())] >= 1
        assert got[("lmkv_tier_usage_bytes", (("tier", "0"), ("type", "cpu")))] > 0
        assert got[("lmkv_tier_available", (("tier", "0"), ("type", "cpu")))] == 1
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"

        over_rpc = lmkv_cli("stats", "--server", address, "--json")
        assert over_rpc.returncode == 0, over_rpc.stderr
        data = json.loads(over_rpc.stdout)
        assert data["live"] and data["metrics"]["counters"]["stored_tokens_total"] == 96
        scraped = lmkv_cli("stats", "--server", url)
        assert scraped.returncode == 0, scraped.stderr
        assert "stores 1: 96 tokens" in scraped.stdout, scraped.stdout
        assert "tier 0 (cpu)" in scraped.stdout
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


@pytest.mark.parametrize("args", [["--server", "http://127.0.0.1:1"],
                                  ["--server", "tcp://127.0.0.1:1", "--watch", "1"]])
def test_lmkv_stats_at_an_unreachable_address_is_one_line(args) -> None:
    done = lmkv_cli("--log-level", "error", "stats", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0], done.stderr


def test_lmkv_server_with_its_metrics_port_taken_is_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = lmkv_cli("server", "--socket", str(tmp_path / "s.sock"),
                        "--metrics-port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"lmkv: error: metrics exporter: cannot listen on 127.0.0.1:{port}: "
        "Address already in use"]


def test_metrics_on_a_non_loopback_host_are_logged_loudly(monkeypatch, caplog) -> None:
    """No socket is bound here (tests stay on loopback): ``serve_metrics`` is replaced
    by one that reports a non-loopback address, to check what the engine says."""
    import types

    import lmkv.engines.open as opener
    import lmkv.metrics.exporter as exporter

    asked = []

    def fake(port: int, host: str = "127.0.0.1"):
        asked.append((port, host))
        return types.SimpleNamespace(host=host, url=f"http://{host}:{port}")

    monkeypatch.setattr(exporter, "serve_metrics", fake)
    config = load_config(env={}, overrides={"lmkv.metrics.port": 9100,
                                            "lmkv.metrics.host": "10.1.2.3"})
    with caplog.at_level("WARNING", logger="lmkv.engines.open"):
        opener.start_metrics(config, worker_id=1)
    assert asked == [(9101, "10.1.2.3")]
    assert any("not loopback" in r.getMessage() and "10.1.2.3" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    opener.start_metrics(load_config(env={}, overrides={"lmkv.metrics.port": 9100}))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
