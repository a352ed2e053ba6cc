"""bench_serve.py's report: per-configuration figures, the target ratios, the plot."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from _serve_workload import BenchError


@dataclass
class Result:
    """One configuration's run: TTFTs at the client, totals, /metrics differences."""

    config: str
    description: str
    error: str | None = None
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0
    left_behind: list[str] = field(default_factory=list)  # a stop that was not clean

    def p(self, q: float) -> float:
        if not self.ttft_s:
            return math.nan
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(self.ttft_s) if self.ttft_s else math.nan

    @property
    def req_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else math.nan

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else math.nan

    def ratio(self, hit: str, *rest: str) -> float | None:
        """``hit`` over ``hit + rest`` (or over ``rest[0]`` alone when it is a
        total), from the metric differences. A labelled counter appears only once
        it counted: an absent one is 0 when another of the set is there; None when
        none is (the server does not export them)."""
        names = (hit, *rest)
        if not any(n in self.metrics for n in names):
            return None
        value = {n: self.metrics.get(n, 0.0) for n in names}
        total = sum(value[r] for r in rest)
        if not rest[0].endswith("queries_total"):
            total += value[hit]
        return value[hit] / total if total else None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _lmkv(metrics: dict[str, float], name: str) -> float | None:
    """An lmkv counter: 0 when it never counted but lmkv exports others, None without lmkv."""
    if name in metrics:
        return metrics[name]
    return 0.0 if any(k.startswith("vllm:lmkv_") for k in metrics) else None


def table(results: list[Result]) -> str:
    head = ("| config | TTFT p50 s | p90 s | mean s | req/s | out tok/s | vLLM prefix hit | "
            "connector hit | lmkv hit | lmkv loaded tok | preemptions |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        if r.error:
            rows.append(f"| {r.config} {r.description} | refused: {r.error} |" + " |" * 9)
            continue
        m = r.metrics
        rows.append(
            f"| {r.config} {r.description} | {_fmt(r.p(0.5))} | {_fmt(r.p(0.9))} | "
            f"{_fmt(r.ttft_mean)} | {_fmt(r.req_per_s, '.2f')} | {_fmt(r.tok_per_s, '.1f')} | "
            f"{_fmt(r.ratio('vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total'), '.2f')} | "  # noqa: E501
            f"{_fmt(r.ratio('vllm:external_prefix_cache_hits_total', 'vllm:external_prefix_cache_queries_total'), '.2f')} | "  # noqa: E501
            f"{_fmt(r.ratio('vllm:lmkv_lookup_hit_tokens_total', 'vllm:lmkv_lookup_miss_tokens_total'), '.2f')} | "  # noqa: E501
            f"{_fmt(_lmkv(m, 'vllm:lmkv_loaded_tokens_total'), '.0f')} | "
            f"{_fmt(m.get('vllm:num_preemptions_total'), '.0f')} |")
    return "\n".join(rows)


def targets(results: list[Result]) -> list[dict[str, Any]]:
    """The served-traffic targets (lmkv's TTFT and throughput against vLLM alone and
    against the other connectors), each with the measured ratio (None: a side is
    missing)."""
    by = {r.config: r for r in results if not r.error and r.ttft_s}

    def ratio(a: str, b: str, attr: str) -> float | None:
        if a not in by or b not in by:
            return None
        x, y = (by[a].p(0.5), by[b].p(0.5)) if attr == "p50" else \
            (getattr(by[a], attr), getattr(by[b], attr))
        return x / y if y else None

    out = [("(c)/(a) TTFT p50", ratio("c", "a", "p50"), "<=", 0.3),
           ("(c)/(b) TTFT p50", ratio("c", "b", "p50"), "<=", 1.5),
           ("(c)/(a) requests/s", ratio("c", "a", "req_per_s"), ">=", 1.0)]
    out += [(f"({x})/(c) TTFT p50", ratio(x, "c", "p50"), "<=", 1.3) for x in "def"]
    for g in ("g", "gs"):
        out += [(f"(c)/({g}) TTFT p50", ratio("c", g, "p50"), "<=", 1.0),
                (f"(c)/({g}) TTFT mean", ratio("c", g, "ttft_mean"), "<=", 1.0),
                (f"(c)/({g}) requests/s", ratio("c", g, "req_per_s"), ">=", 1.0),
                (f"(c)/({g}) output tok/s", ratio("c", g, "tok_per_s"), ">=", 1.0)]
    return [{"ratio": name, "value": value, "target": f"{op} {limit}",
             "met": None if value is None else (value <= limit if op == "<=" else value >= limit)}
            for name, value, op, limit in out]


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib (pip install matplotlib)") from None
    shown = [r for r in results if r.ttft_s]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in shown:
        xs = sorted(r.ttft_s)
        ax.step([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                where="post", label=f"({r.config}) {r.description}")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution per configuration (bench_serve.py)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
