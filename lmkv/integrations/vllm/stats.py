"""lmkv's figures in vLLM's own metrics: the connector stats API.

Each connector instance (scheduler side, every worker) hands vLLM what its
process's recorder gathered since it last asked (``get_kv_connector_stats``);
vLLM sums the workers' and the scheduler's intervals (``aggregate``), logs a
summary (``reduce``) and records them into its Prometheus registry through
``LMKVPromMetrics`` (``vllm:lmkv_<name>``, the names of
``lmkv.metrics.catalog``), so they appear in ``vllm serve``'s ``/metrics``.

The payload is plain data (it crosses processes): ``counters`` (deltas),
``samples`` (latencies in seconds), ``gauges``, and ``tiers`` keyed by
``"<tier>/<type>@<rank>"`` (counter deltas and gauge values of each worker's
tiers; the rank keeps workers apart until the gauges are summed per tier).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmkv.metrics import CATALOG, LATENCY_BUCKETS, recorder
from lmkv.metrics.catalog import TIER_LABELS

MAX_SAMPLES = 8192  # latency samples kept per histogram in one payload
GAUGE_EVERY_S = 1.0  # an idle worker still sends its tiers' gauges this often


class LMKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not self.data

    def reduce(self) -> dict[str, int | float]:
        """The periodic log line: the interval's tokens and mean latencies."""
        counters = self.data.get("counters", {})
        out: dict[str, int | float] = {}
        for name in ("lookup_hit_tokens_total", "lookup_miss_tokens_total",
                     "loaded_tokens_total", "stored_tokens_total", "failed_load_tokens_total"):
            if name in counters:
                out[name.removesuffix("_total")] = int(counters[name])
        asked = counters.get("lookup_hit_tokens_total", 0) + counters.get(
            "lookup_miss_tokens_total", 0)
        if asked:
            out["lookup_hit_rate"] = round(counters.get("lookup_hit_tokens_total", 0) / asked, 3)
        for name, samples in self.data.get("samples", {}).items():
            if samples:
                out[f"{name.removesuffix('_seconds')}_ms_avg"] = round(
                    1e3 * sum(samples) / len(samples), 3)
        return out


def merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Sum counters, join samples (bounded), keep the latest gauges and tier rows."""
    for name, value in other.get("counters", {}).items():
        counters = into.setdefault("counters", {})
        counters[name] = counters.get(name, 0) + value
    for name, values in other.get("samples", {}).items():
        samples = into.setdefault("samples", {}).setdefault(name, [])
        samples.extend(values[:max(0, MAX_SAMPLES - len(samples))])
    if other.get("gauges"):
        into.setdefault("gauges", {}).update(other["gauges"])
    for key, figures in other.get("tiers", {}).items():
        row = into.setdefault("tiers", {}).setdefault(key, {})
        for metric, value in figures.items():
            if metric.endswith("_total"):
                row[metric] = row.get(metric, 0) + value
            else:
                row[metric] = value


class StatsTaker:
    """What one connector instance hands vLLM each time it asks."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank  # a worker's rank; None on the scheduler side (no tiers)
        self._gauges_at = 0.0

    def take(self) -> LMKVStats | None:
        data = recorder().take(tiers=self.rank is not None)
        tiers = data.pop("tiers", None)
        if tiers and self.rank is not None:
            data["tiers"] = {f"{key}@{self.rank}": row for key, row in tiers.items()}
        now = time.monotonic()
        news = data.get("counters") or data.get("samples")
        if not news and now - self._gauges_at < GAUGE_EVERY_S:
            return None  # nothing new: vLLM sends nothing this step
        if not data:
            return None
        self._gauges_at = now
        return LMKVStats(data=data)


class LMKVPromMetrics(KVConnectorPromMetrics):
    """Registers every catalog metric as ``vllm:lmkv_<name>`` and records payloads."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        #: engine, tier labels -> rank -> gauge figures: the latest of every worker
        self._tier_gauges: dict[tuple[int, tuple[str, ...]], dict[str, dict[str, float]]] = {}
        for metric in CATALOG:
            labels = [*self._labelnames, *metric.labels]
            name = f"vllm:lmkv_{metric.name}"
            if metric.kind == "counter":
                made = self._counter_cls(name=name, documentation=metric.help,
                                         labelnames=labels)
            elif metric.kind == "gauge":
                made = self._gauge_cls(name=name, documentation=metric.help,
                                       labelnames=labels, multiprocess_mode="mostrecent")
            else:
                made = self._histogram_cls(name=name, documentation=metric.help,
                                           labelnames=labels, buckets=list(LATENCY_BUCKETS))
            self._metrics[metric.name] = made

    def _child(self, name: str, engine_idx: int, extra: tuple[str, ...] = ()) -> Any:
        values = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        return self._metrics[name].labels(*values, *extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for name, delta in data.get("counters", {}).items():
            if name in self._metrics and delta > 0:
                self._child(name, engine_idx).inc(delta)
        for name, samples in data.get("samples", {}).items():
            if name in self._metrics:
                child = self._child(name, engine_idx)
                for seconds in samples:
                    child.observe(seconds)
        for name, value in data.get("gauges", {}).items():
            if name in self._metrics:
                self._child(name, engine_idx).set(value)
        touched = set()
        for key, figures in data.get("tiers", {}).items():
            where, _, rank = key.partition("@")
            tier, _, kind = where.partition("/")
            labels = (tier, kind)[:len(TIER_LABELS)]
            for name, value in figures.items():
                if name not in self._metrics:
                    continue
                if name.endswith("_total"):
                    if value > 0:
                        self._child(name, engine_idx, labels).inc(value)
                else:
                    ranks = self._tier_gauges.setdefault((engine_idx, labels), {})
                    ranks.setdefault(rank, {})[name] = value
                    touched.add(labels)
        for labels in touched:  # a tier's gauges: summed over the workers' latest
            summed: dict[str, float] = {}
            for row in self._tier_gauges[(engine_idx, labels)].values():
                for name, value in row.items():
                    summed[name] = summed.get(name, 0) + value
            for name, value in summed.items():
                self._child(name, engine_idx, labels).set(value)
