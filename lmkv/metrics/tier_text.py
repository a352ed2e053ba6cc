"""Per-tier counters as text: shared by ``lmkv stats`` and ``lmkv demo``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MiB = 1 << 20
COUNTERS = ("hits", "misses", "puts", "bytes_in", "bytes_out", "evictions", "errors",
            "dropped_writes", "corrupt_frames", "admission_rejects")


def _size(value: Any) -> str:
    return "-" if value is None else f"{value / MiB:.1f} MiB"


def format_tier_stats(stats: Sequence[dict[str, Any]], indent: str = "  ") -> list[str]:
    """One line per tier: usage, capacity, then every counter."""
    lines = []
    for tier in stats:
        head = f"tier {tier['tier']} ({tier['type']})"
        usage = f"usage {_size(tier.get('usage_bytes'))} of {_size(tier.get('capacity_bytes'))}"
        entries = f", {tier['entries']} entries" if "entries" in tier else ""
        counters = " ".join(f"{name}={tier.get(name, 0)}" for name in COUNTERS)
        queue = (f" write_queue={tier['write_queue_chunks']}"
                 if "write_queue_chunks" in tier else "")
        lines.append(f"{indent}{head}: {usage}{entries}; {counters}{queue}")
    return lines


def format_figures(figures: dict[str, Any]) -> list[str]:
    """The recorded figures (``lmkv.metrics.Totals.plain()``) as a few lines: lookups
    and their hit ratio, loads, stores, and the mean of each latency."""
    counters = figures.get("counters", {})

    def count(name: str) -> int:
        return int(counters.get(name, 0))

    hit, miss = count("lookup_hit_tokens_total"), count("lookup_miss_tokens_total")
    ratio = f"{hit / (hit + miss):.3f}" if hit + miss else "-"
    lines = [f"lookups {count('lookups_total')}: hit tokens {hit}, missed {miss}, "
             f"hit ratio {ratio}",
             f"loads {count('loads_total')}: {count('loaded_tokens_total')} tokens, "
             f"{count('load_bytes_total') / MiB:.1f} MiB; failed tokens "
             f"{count('failed_load_tokens_total')}",
             f"stores {count('stores_total')}: {count('stored_tokens_total')} tokens, "
             f"{count('store_bytes_total') / MiB:.1f} MiB"]
    means = []
    for name, hist in sorted(figures.get("histograms", {}).items()):
        if hist.get("count"):
            means.append(f"{name.removesuffix('_seconds')} "
                         f"{1e3 * hist['sum'] / hist['count']:.3f} ms ({hist['count']})")
    if means:
        lines.append("mean latency: " + ", ".join(means))
    depth = figures.get("gauges", {}).get("lazy_offload_queue_depth")
    if depth:
        lines.append(f"lazy-offload queue {int(depth)}")
    return lines
