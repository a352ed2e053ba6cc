"""What ``lmkv replay`` prints: rows per policy and capacity, as a table, as JSON,
and as a plot of hit ratio against capacity (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmkv.base.errors import LMKVError
from lmkv.replay.defaults import PHYSICAL_CHUNK_BYTES
from lmkv.replay.run import RunResult
from lmkv.replay.sizing import Capacity, ModelShape, human_bytes
from lmkv.replay.trace import Trace

PLOT_INSTALL = "pip install 'lmkv[plot]'"


@dataclass(frozen=True)
class Row:
    """One policy at one capacity, beside Belady's optimum at that capacity."""

    capacity: Capacity
    run: RunResult
    belady_hits: int

    @property
    def belady_hit_ratio(self) -> float:
        return self.belady_hits / self.run.chunk_requests if self.run.chunk_requests else 0.0

    @property
    def of_optimum(self) -> float | None:
        best = self.belady_hit_ratio
        return self.run.hit_ratio / best if best else None


def as_json(trace: Trace, shape: ModelShape, rows: Sequence[Row]) -> dict[str, Any]:
    chunk_bytes = shape.chunk_bytes(trace.tokens_per_chunk)
    return {
        "trace": trace.path, "format": trace.format, "requests": len(trace.requests),
        "chunk_requests": trace.chunk_requests, "unique_chunks": trace.unique_chunks,
        "tokens_per_chunk": trace.tokens_per_chunk,
        "model": {"bytes_per_token": shape.bytes_per_token, "chunk_bytes": chunk_bytes},
        "physical_chunk_bytes": PHYSICAL_CHUNK_BYTES,
        "rows": [_row_json(row, trace, chunk_bytes) for row in rows],
    }


def _row_json(row: Row, trace: Trace, chunk_bytes: int) -> dict[str, Any]:
    run = row.run
    return {
        "policy": run.policy, "capacity": row.capacity.label,
        "capacity_chunks": row.capacity.chunks,
        "capacity_bytes": row.capacity.chunks * chunk_bytes,
        "capacity_percent": 100 * row.capacity.chunks / trace.unique_chunks,
        "hits": run.hits, "chunk_requests": run.chunk_requests,
        "hit_ratio": run.hit_ratio, "belady_hits": row.belady_hits,
        "belady_hit_ratio": row.belady_hit_ratio, "of_optimum": row.of_optimum,
        "chunks_stored": run.chunks_stored, "chunks_unstored": run.chunks_unstored,
        "seconds": run.seconds, "chunk_ops": run.chunk_ops,
        "chunk_ops_per_s": run.chunk_ops / run.seconds if run.seconds else None,
        "tiers": [{"tier": t.tier, "type": t.type,
                   "chunks_written": t.chunks_written, "chunks_read": t.chunks_read,
                   "bytes_written": t.chunks_written * chunk_bytes,
                   "bytes_read": t.chunks_read * chunk_bytes,
                   "evictions": t.evictions, "dropped_writes": t.dropped_writes}
                  for t in run.tiers],
    }


def as_table(trace: Trace, shape: ModelShape, rows: Sequence[Row]) -> str:
    chunk_bytes = shape.chunk_bytes(trace.tokens_per_chunk)
    lines = [
        f"trace {trace.path} ({trace.format}): {len(trace.requests)} requests, "
        f"{trace.chunk_requests} chunk requests, {trace.unique_chunks} unique chunks of "
        f"{trace.tokens_per_chunk} tokens",
        f"model: {shape.describe()}; a chunk is {human_bytes(chunk_bytes)} (the tiers ran on "
        f"{human_bytes(PHYSICAL_CHUNK_BYTES)} chunks, capacities scaled alike; bytes are "
        "at the model's size)",
        "",
    ]
    tiers = rows[0].run.tiers if rows else []
    header = ["POLICY", "CAPACITY", "CHUNKS", "SIZE", "HIT RATIO", "BELADY", "OF OPTIMUM"]
    for t in tiers:
        header += [f"T{t.tier} {t.type} WRITTEN", f"T{t.tier} READ"]
    header += ["TIME", "CHUNK OPS/S"]
    table = [header]
    for row in rows:
        run = row.run
        cells = [run.policy, row.capacity.label, str(row.capacity.chunks),
                 human_bytes(row.capacity.chunks * chunk_bytes), f"{run.hit_ratio:.3f}",
                 f"{row.belady_hit_ratio:.3f}",
                 "-" if row.of_optimum is None else f"{row.of_optimum:.2f}"]
        for t in run.tiers:
            cells += [human_bytes(t.chunks_written * chunk_bytes),
                      human_bytes(t.chunks_read * chunk_bytes)]
        rate = run.chunk_ops / run.seconds if run.seconds else 0.0
        cells += [f"{run.seconds:.1f}s", f"{rate:,.0f}"]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in table]
    return "\n".join(lines)


def check_plot_available() -> None:
    """LMKVError naming the extra when matplotlib is missing: said before any replay."""
    if importlib.util.find_spec("matplotlib") is None:
        raise LMKVError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}")


def write_plot(path: str, trace: Trace, rows: Sequence[Row]) -> None:
    """Hit ratio against capacity (percent of the unique chunks): one line per policy
    and one, dashed, for Belady's optimum."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    def percent(row: Row) -> float:
        return 100 * row.capacity.chunks / trace.unique_chunks

    figure, axes = plt.subplots(figsize=(7, 4.5))
    try:
        policies = list(dict.fromkeys(row.run.policy for row in rows))
        for policy in policies:
            mine = sorted((r for r in rows if r.run.policy == policy), key=percent)
            axes.plot([percent(r) for r in mine], [r.run.hit_ratio for r in mine],
                      marker="o", label=policy)
        best = sorted({percent(r): r for r in rows}.values(), key=percent)
        axes.plot([percent(r) for r in best], [r.belady_hit_ratio for r in best],
                  linestyle="--", color="black", marker="x", label="Belady (optimum)")
        axes.set_xlabel("capacity (% of the trace's unique chunks)")
        axes.set_ylabel("prefix hit ratio (chunks reused / requested)")
        axes.set_title(f"lmkv replay: {trace.path}", fontsize=9)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        try:
            figure.savefig(path, format="png")
        except OSError as exc:
            raise LMKVError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
