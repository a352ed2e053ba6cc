"""lmkv's figures in vLLM's own metrics (the connector stats API).

Runs in the vLLM venv; skipped where vLLM is not installed. The last test runs
a real vLLM (CPU build) in a subprocess with the connector and reads vLLM's
Prometheus registry, which ``vllm serve`` exposes as ``/metrics``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lmkv.integrations.vllm.connector import LMKVConnector
from lmkv.integrations.vllm.stats import LMKVStats, StatsTaker
from lmkv.metrics import recorder

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def _types(registry: CollectorRegistry) -> dict:
    def bound(cls):  # type: ignore[no-untyped-def]
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *args, multiprocess_mode: str = "", **kwargs) -> None:
                if cls is Gauge and multiprocess_mode:
                    kwargs["multiprocess_mode"] = multiprocess_mode
                super().__init__(*args, registry=registry, **kwargs)
        return Bound
    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def _value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_workers_and_intervals_aggregate() -> None:
    a = LMKVStats(data={"counters": {"loaded_tokens_total": 256},
                        "samples": {"load_seconds": [0.002]},
                        "tiers": {"0/cpu@0": {"tier_usage_bytes": 10, "tier_hits_total": 1}}})
    b = LMKVConnector.build_kv_connector_stats(
        {"counters": {"loaded_tokens_total": 128, "lookup_hit_tokens_total": 384,
                      "lookup_miss_tokens_total": 128},
         "samples": {"load_seconds": [0.004]},
         "tiers": {"0/cpu@0": {"tier_usage_bytes": 30, "tier_hits_total": 2}}})
    merged = a.aggregate(b)
    assert merged.data["counters"]["loaded_tokens_total"] == 384
    assert merged.data["tiers"]["0/cpu@0"] == {"tier_usage_bytes": 30, "tier_hits_total": 3}
    line = merged.reduce()
    assert line["loaded_tokens"] == 384 and line["lookup_hit_rate"] == 0.75
    assert line["load_ms_avg"] == pytest.approx(3.0)
    assert not merged.is_empty() and LMKVStats().is_empty()


def test_prometheus_metrics_sum_tier_gauges_over_ranks() -> None:
    registry = CollectorRegistry()
    prom = LMKVConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                            _types(registry), ["engine"], {0: ["0"]})
    prom.observe({"counters": {"loaded_tokens_total": 640},
                  "samples": {"lookup_seconds": [0.0004, 0.02]},
                  "gauges": {"lazy_offload_queue_depth": 3},
                  "tiers": {"0/cpu@0": {"tier_usage_bytes": 100, "tier_evictions_total": 2},
                            "0/cpu@1": {"tier_usage_bytes": 50}}})
    prom.observe({"tiers": {"0/cpu@1": {"tier_usage_bytes": 70, "tier_evictions_total": 1}}})
    text = generate_latest(registry).decode()
    assert _value(text, "vllm:lmkv_loaded_tokens_total", engine="0") == 640
    assert _value(text, "vllm:lmkv_lookup_seconds_count", engine="0") == 2
    assert _value(text, "vllm:lmkv_lookup_seconds_bucket", engine="0", le="0.0005") == 1
    assert _value(text, "vllm:lmkv_lazy_offload_queue_depth", engine="0") == 3
    # rank 0's latest (100) plus rank 1's latest (70); counters add up
    assert _value(text, "vllm:lmkv_tier_usage_bytes", tier="0", type="cpu") == 170
    assert _value(text, "vllm:lmkv_tier_evictions_total", tier="0", type="cpu") == 3


def test_a_worker_hands_its_tiers_an_idle_scheduler_nothing() -> None:
    class Engine:
        def stats(self) -> list[dict]:
            return [{"tier": 0, "type": "cpu", "usage_bytes": 7, "hits": 1}]

    engine = Engine()
    recorder().add_tier_source(engine.stats)
    recorder().take()  # whatever other tests left
    worker, scheduler = StatsTaker(rank=2), StatsTaker(rank=None)
    recorder().add("stored_tokens_total", 256)
    got = worker.take()
    assert got is not None and got.data["counters"] == {"stored_tokens_total": 256}
    assert "0/cpu@2" in got.data["tiers"]
    assert scheduler.take() is None  # nothing new, and no tiers of its own
    assert worker.take() is None  # gauges only: not again within a second


PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import e2e_vllm as e
    e.build({model!r})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import prometheus_client
    llm = LLM(model={model!r}, enforce_eager=True, dtype="float32", max_model_len=2048,
              enable_prefix_caching=False, max_num_seqs=4, seed=0, disable_log_stats=False,
              kv_transfer_config={{"kv_connector": "LMKVConnector",
                                  "kv_connector_module_path": "lmkv.integrations.vllm",
                                  "kv_role": "kv_both",
                                  "kv_connector_extra_config": {{"lmkv.chunk_size": 256,
                                                                "lmkv.metrics.port": 0}}}})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for p in e.prompts():
        llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
    print("METRICS" + json.dumps(prometheus_client.generate_latest().decode()))
    import urllib.request
    from lmkv.metrics.exporter import serve_metrics
    with urllib.request.urlopen(serve_metrics(0).url + "/metrics") as reply:  # lmkv.metrics.port
        print("OWN" + json.dumps(reply.read().decode()))
""")


@pytest.mark.slow  # a real vLLM run
def test_a_real_vllm_exports_lmkv_figures(tmp_path) -> None:
    script = PROBE.format(tests=str(ROOT / "tests" / "vllm"), model=str(tmp_path / "model"))
    cpus = f"0-{(os.cpu_count() or 1) - 1}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = json.loads(out.stdout.split("METRICS", 1)[1].split("\nOWN", 1)[0])
    own = json.loads(out.stdout.split("\nOWN", 1)[1])
    # The second prompt shares 640 tokens (five 128-token blocks) with the first.
    assert _value(text, "vllm:lmkv_loaded_tokens_total") == 640
    assert _value(text, "vllm:lmkv_lookup_hit_tokens_total") == 640
    assert _value(text, "vllm:lmkv_lookups_total") == 2
    assert _value(text, "vllm:lmkv_stored_tokens_total") >= 640
    assert _value(text, "vllm:lmkv_load_seconds_count") == 1
    assert _value(text, "vllm:lmkv_tier_usage_bytes", tier="0", type="cpu") > 0
    # lmkv.metrics.port: the worker's own endpoint serves the same figures, each
    # counted once (the engine below the connector does not record them again)
    assert _value(own, "lmkv_loaded_tokens_total") == 640
    assert _value(own, "lmkv_lookups_total") == 2
    assert _value(own, "lmkv_loads_total") == 1
