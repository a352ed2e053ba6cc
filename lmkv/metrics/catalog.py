"""Every figure lmkv exports, named once.

The same names serve both paths: inside vLLM they appear in ``vllm serve``'s
``/metrics`` as ``vllm:lmkv_<name>`` (through vLLM's connector stats), outside
vLLM (``lmkv server --metrics-port``, ``lmkv.metrics.port``) as
``lmkv_<name>``. docs/metrics.md documents each; a test checks that the page
and this table agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Latency buckets in seconds: a lookup answered from memory takes well under a
#: millisecond, a load from disk or S3 up to seconds.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Labels of the per-tier figures: the tier's position (0 is the first) and type.
TIER_LABELS = ("tier", "type")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


def _tier(name: str, kind: Kind, help: str) -> Metric:
    return Metric(name, kind, help, TIER_LABELS)


CATALOG: tuple[Metric, ...] = (
    # lookups (the scheduler's question: how much of this prompt is stored?)
    Metric("lookups_total", "counter", "Prompts lmkv was asked about."),
    Metric("lookup_hit_tokens_total", "counter",
           "Prompt tokens a lookup found stored (the strict prefix, in whole blocks)."),
    Metric("lookup_miss_tokens_total", "counter",
           "Prompt tokens a lookup asked about and did not find."),
    Metric("lookup_seconds", "histogram", "Time from asking a lookup to its answer."),
    # loads (stored KV copied into the engine's cache)
    Metric("loads_total", "counter", "Loads of stored KV into the engine's cache."),
    Metric("loaded_tokens_total", "counter", "Tokens whose KV a load put into the engine's cache."),
    Metric("load_bytes_total", "counter", "Bytes of KV loads copied into the engine's cache."),
    Metric("load_seconds", "histogram", "Time a load took (the worker's part)."),
    Metric("failed_load_tokens_total", "counter",
           "Tokens a load was planned for and did not bring (the engine recomputes them)."),
    # stores (KV copied out of the engine's cache into the tiers)
    Metric("stores_total", "counter", "Stores of computed KV into lmkv."),
    Metric("stored_tokens_total", "counter", "Tokens whose KV a store handed to lmkv."),
    Metric("store_bytes_total", "counter", "Bytes of KV stores copied out of the engine's cache."),
    Metric("store_seconds", "histogram",
           "Time a store took on the engine's side (the copy out; tiers write behind)."),
    Metric("decode_stored_tokens_total", "counter",
           "Tokens generated during decode whose KV was stored (store_decode)."),
    Metric("preempted_resumes_total", "counter",
           "Preempted requests that loaded KV from lmkv when they resumed."),
    Metric("lazy_offload_queue_depth", "gauge",
           "Requests waiting in the lazy-offload queue (0 without lazy offload)."),
    Metric("lazy_offload_rescues_total", "counter",
           "Lazy stores made in the step vLLM handed their freed blocks to another request "
           "(one cut short at a block that lost its KV counts too)."),
    Metric("lazy_offload_skipped_total", "counter",
           "Lazy stores dropped because vLLM had already reused their blocks."),
    # tiers
    _tier("tier_usage_bytes", "gauge", "Bytes a tier holds."),
    _tier("tier_capacity_bytes", "gauge", "A tier's capacity in bytes (absent when unbounded)."),
    _tier("tier_entries", "gauge", "Entries a tier holds."),
    _tier("tier_hits_total", "counter", "Chunks a tier found."),
    _tier("tier_misses_total", "counter", "Chunks asked of a tier and not found."),
    _tier("tier_puts_total", "counter", "Chunks a tier stored."),
    _tier("tier_admission_rejects_total", "counter",
          "Chunks offered to a tier before their admit_after-th sighting (not stored)."),
    _tier("tier_evictions_total", "counter", "Chunks a tier evicted to make room."),
    _tier("tier_errors_total", "counter", "Operations a tier failed (it degrades to misses)."),
    _tier("tier_dropped_writes_total", "counter",
          "Writes a tier dropped (full, its queue full, or given up to make room in the "
          "first tier)."),
    _tier("tier_corrupt_frames_total", "counter",
          "Entries a tier found corrupt or not the chunk asked for (miss, removed)."),
    _tier("tier_bytes_in_total", "counter", "Bytes written into a tier."),
    _tier("tier_bytes_out_total", "counter", "Bytes read out of a tier."),
    _tier("tier_available", "gauge",
          "1 while a tier answers, 0 while its circuit breaker is open and it serves "
          "misses (inside vLLM: summed over the workers)."),
)

BY_NAME = {m.name: m for m in CATALOG}

#: Tier figures and the key of lmkv's per-tier stats dict they come from.
TIER_SOURCES = {
    "tier_usage_bytes": "usage_bytes", "tier_capacity_bytes": "capacity_bytes",
    "tier_entries": "entries", "tier_hits_total": "hits", "tier_misses_total": "misses",
    "tier_puts_total": "puts", "tier_admission_rejects_total": "admission_rejects",
    "tier_evictions_total": "evictions", "tier_errors_total": "errors",
    "tier_dropped_writes_total": "dropped_writes", "tier_corrupt_frames_total": "corrupt_frames",
    "tier_bytes_in_total": "bytes_in", "tier_bytes_out_total": "bytes_out",
    "tier_available": "available",
}
