"""The metric catalog and the per-process recorder (no vLLM, no Prometheus)."""

from __future__ import annotations

import gc
import threading

import pytest

from lmkv.metrics import BY_NAME, CATALOG, LATENCY_BUCKETS, Recorder


def test_names_are_unique_and_counters_say_total() -> None:
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    for metric in CATALOG:
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        assert metric.help.endswith("."), metric.name


def test_take_hands_each_change_over_once() -> None:
    rec = Recorder()
    rec.add("loaded_tokens_total", 256)
    rec.add("loaded_tokens_total", 128)
    rec.observe("load_seconds", 0.003)
    rec.set_gauge("lazy_offload_queue_depth", 4)
    first = rec.take(tiers=False)
    assert first == {"counters": {"loaded_tokens_total": 384},
                     "samples": {"load_seconds": [0.003]},
                     "gauges": {"lazy_offload_queue_depth": 4}}
    assert rec.take(tiers=False) == {"gauges": {"lazy_offload_queue_depth": 4}}
    rec.add("loaded_tokens_total", 1)
    assert rec.take(tiers=False)["counters"] == {"loaded_tokens_total": 1}
    totals = rec.totals()  # take never resets the totals
    assert totals.counters["loaded_tokens_total"] == 385
    hist = totals.histograms["load_seconds"]
    assert hist.count == 1 and hist.sum == pytest.approx(0.003)
    assert sum(hist.counts) == 1 and len(hist.counts) == len(LATENCY_BUCKETS) + 1


def test_a_name_outside_the_catalog_or_of_another_kind_is_refused() -> None:
    rec = Recorder()
    with pytest.raises(KeyError):
        rec.add("no_such_metric_total")
    with pytest.raises(ValueError, match="is a histogram, not a counter"):
        rec.add("load_seconds")
    with pytest.raises(ValueError, match="is a counter, not a histogram"):
        rec.observe("loads_total", 1.0)


class _Engine:
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def stats(self) -> list[dict]:
        return self.rows


def test_tier_figures_come_from_the_sources_as_deltas_and_gauges() -> None:
    rec = Recorder(tier_interval_s=0)
    engine = _Engine([{"tier": 0, "type": "cpu", "usage_bytes": 100, "capacity_bytes": 1000,
                       "hits": 5, "evictions": 2, "write_queue_chunks": 0}])
    rec.add_tier_source(engine.stats)
    assert rec.take()["tiers"] == {"0/cpu": {"tier_usage_bytes": 100,
                                             "tier_capacity_bytes": 1000,
                                             "tier_hits_total": 5,
                                             "tier_evictions_total": 2}}
    engine.rows[0].update(hits=7, usage_bytes=50)
    assert rec.take()["tiers"] == {"0/cpu": {"tier_usage_bytes": 50,
                                             "tier_capacity_bytes": 1000,
                                             "tier_hits_total": 2}}
    assert rec.totals().tiers == engine.rows
    del engine  # held weakly: a closed engine drops out
    gc.collect()
    assert rec.totals().tiers == []


def test_two_engines_of_one_process_give_one_row_per_tier() -> None:
    rec = Recorder(tier_interval_s=0)
    first = _Engine([{"tier": 0, "type": "cpu", "usage_bytes": 100, "capacity_bytes": 1000,
                      "hits": 5, "puts": 2, "available": 1},
                     {"tier": 1, "type": "fs", "usage_bytes": 10, "capacity_bytes": None,
                      "available": 1}])
    second = _Engine([{"tier": 0, "type": "cpu", "usage_bytes": 50, "capacity_bytes": 500,
                       "hits": 1, "puts": 3, "available": 0},
                      {"tier": 1, "type": "fs", "usage_bytes": 20, "capacity_bytes": 64,
                       "available": 1}])
    rec.add_tier_source(first.stats)
    rec.add_tier_source(second.stats)
    rows = {(r["tier"], r["type"]): r for r in rec.tiers()}
    assert len(rows) == 2  # Prometheus takes one sample per label set
    assert rows[0, "cpu"] == {"tier": 0, "type": "cpu", "usage_bytes": 150,
                              "capacity_bytes": 1500, "hits": 6, "puts": 5, "available": 0}
    assert rows[1, "fs"]["usage_bytes"] == 30
    assert rows[1, "fs"]["capacity_bytes"] is None  # one of them is unbounded
    assert rows[1, "fs"]["available"] == 1


def test_a_failing_source_gives_no_rows_and_no_error() -> None:
    rec = Recorder(tier_interval_s=0)

    def broken() -> list[dict]:
        raise ConnectionError("server gone")

    rec.add_tier_source(broken)
    assert rec.tiers() == []


def test_counts_from_many_threads_add_up() -> None:
    rec = Recorder()

    def work() -> None:
        for _ in range(2000):
            rec.add("lookups_total")
            rec.observe("lookup_seconds", 0.0001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.totals().counters["lookups_total"] == 8000
    assert rec.totals().histograms["lookup_seconds"].count == 8000


def test_requests_recorded_from_many_threads_add_up_across_takes() -> None:
    """``record`` queues each request's figures; readers add them up, and the queue
    adds itself up when nobody reads: no figure is lost or counted twice."""
    rec = Recorder(max_samples=20000)
    taken: list[dict] = []

    def work() -> None:
        for _ in range(3000):
            rec.record((("loads_total", 1), ("loaded_tokens_total", 2)), "load_seconds", 1e-4)

    def reader() -> None:
        for _ in range(50):
            taken.append(rec.take(tiers=False))

    threads = [threading.Thread(target=work) for _ in range(4)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken.append(rec.take(tiers=False))
    loads = sum(t.get("counters", {}).get("loads_total", 0) for t in taken)
    samples = sum(len(t.get("samples", {}).get("load_seconds", [])) for t in taken)
    assert loads == 12000 and samples == 12000
    totals = rec.totals()
    assert totals.counters["loaded_tokens_total"] == 24000
    assert totals.histograms["load_seconds"].count == 12000
    quiet = Recorder()
    for _ in range(1000):  # (never read: the queue stays bounded)
        quiet.record((("loads_total", 1),), "load_seconds", 1e-4)
    assert len(quiet._pending) < 300
    assert quiet.totals().counters["loads_total"] == 1000


def test_catalog_lookup_by_name() -> None:
    assert BY_NAME["tier_usage_bytes"].labels == ("tier", "type")


def test_what_a_lookup_load_and_store_record_are_catalog_names_of_their_kind() -> None:
    import time

    from lmkv.metrics import recorder
    from lmkv.metrics.record import record_load, record_lookup, record_store

    before = recorder().totals()
    record_lookup(512, 256, time.perf_counter())
    record_load(256, 1024, time.perf_counter())
    record_store(128, 512, time.perf_counter())
    after = recorder().totals()
    grown = {n for n, v in after.counters.items() if v != before.counters.get(n, 0)}
    assert grown == {"lookups_total", "lookup_hit_tokens_total", "lookup_miss_tokens_total",
                     "loads_total", "loaded_tokens_total", "load_bytes_total",
                     "stores_total", "stored_tokens_total", "store_bytes_total"}
    assert all(BY_NAME[n].kind == "counter" for n in grown)
    assert after.counters["lookup_miss_tokens_total"] - before.counters.get(
        "lookup_miss_tokens_total", 0) == 256
    for name in ("lookup_seconds", "load_seconds", "store_seconds"):
        assert BY_NAME[name].kind == "histogram"
        had = before.histograms.get(name)
        assert after.histograms[name].count == (had.count if had else 0) + 1
