"""The Prometheus exporter outside vLLM: real HTTP on 127.0.0.1, parsed back."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmkv.base.errors import LMKVError
from lmkv.metrics import CATALOG, LATENCY_BUCKETS, Recorder
from lmkv.metrics.exporter import MetricsServer, health


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class _Engine:
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def stats(self) -> list[dict]:
        return self.rows


@pytest.fixture()
def served():
    rec = Recorder(tier_interval_s=0)
    server = MetricsServer(0, rec=rec)
    yield rec, server
    server.close()


def test_every_catalog_metric_is_served_with_what_was_recorded(served) -> None:
    rec, server = served
    assert server.host == "127.0.0.1"  # closed by default: loopback
    engine = _Engine([{"tier": 0, "type": "cpu", "usage_bytes": 100, "capacity_bytes": None,
                       "hits": 5, "puts": 4, "admission_rejects": 2, "available": 1}])
    rec.add_tier_source(engine.stats)
    rec.add("lookup_hit_tokens_total", 256)
    rec.add("lookup_miss_tokens_total", 64)
    rec.observe("load_seconds", 0.003)
    rec.observe("load_seconds", 7.0)
    rec.set_gauge("lazy_offload_queue_depth", 3)
    status, text = _get(server.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for metric in CATALOG:
        name = "lmkv_" + metric.name.removesuffix("_total")
        assert name in families, name
        assert families[name].type == metric.kind
    got = _samples(text)
    assert got[("lmkv_lookup_hit_tokens_total", ())] == 256
    assert got[("lmkv_lookup_miss_tokens_total", ())] == 64
    assert got[("lmkv_stores_total", ())] == 0  # never recorded: 0, not absent
    assert got[("lmkv_lazy_offload_queue_depth", ())] == 3
    assert got[("lmkv_load_seconds_count", ())] == 2
    assert got[("lmkv_load_seconds_sum", ())] == pytest.approx(7.003)
    assert got[("lmkv_load_seconds_bucket", (("le", "0.005"),))] == 1  # cumulative
    assert got[("lmkv_load_seconds_bucket", (("le", "10.0"),))] == 2
    assert got[("lmkv_load_seconds_bucket", (("le", "+Inf"),))] == 2
    assert len([k for k in got if k[0] == "lmkv_load_seconds_bucket"]) == \
        len(LATENCY_BUCKETS) + 1
    tier = (("tier", "0"), ("type", "cpu"))
    assert got[("lmkv_tier_usage_bytes", tier)] == 100
    assert got[("lmkv_tier_hits_total", tier)] == 5
    assert got[("lmkv_tier_puts_total", tier)] == 4
    assert got[("lmkv_tier_admission_rejects_total", tier)] == 2
    assert ("lmkv_tier_capacity_bytes", tier) not in got  # unbounded: absent


def test_health_is_ok_then_degraded_with_200_and_503_only_when_strict(served) -> None:
    rec, server = served
    engine = _Engine([{"tier": 0, "type": "cpu", "available": 1},
                      {"tier": 1, "type": "redis", "available": 1}])
    rec.add_tier_source(engine.stats)
    status, body = _get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    engine.rows[1]["available"] = 0
    status, body = _get(server.url + "/health")
    data = json.loads(body)
    assert status == 200 and data["status"] == "degraded"
    assert [t["reachable"] for t in data["tiers"]] == [True, False]
    assert _get(server.url + "/health?strict=1")[0] == 503
    assert _get(server.url + "/nothing")[0] == 404
    assert health(rec)["status"] == "degraded"


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LMKVError, match=f"cannot listen on 127.0.0.1:{port}") as info:
            MetricsServer(port, rec=Recorder())
    assert "\n" not in str(info.value)
