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
