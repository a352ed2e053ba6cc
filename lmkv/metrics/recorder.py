"""One process's figures: counters, gauges, latency samples, and the tiers' own stats.

The hot path only adds to a dict under a lock (``add``, ``observe``), or queues
a request's figures without one (``record``): no formatting, no I/O. Two
readers, each at its own pace, add up what was queued first:

* ``totals()``: everything since start (Prometheus outside vLLM scrapes it);
* ``take()``: what changed since the previous ``take`` (vLLM asks every step
  for its connector stats and sums the intervals itself).

Tier figures are not recorded: they are read from the engines' ``stats()`` (a
*source*, registered with ``add_tier_source``), at most once per
``tier_interval_s``, since a remote engine's stats cost a round trip.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmkv.metrics.catalog import BY_NAME, LATENCY_BUCKETS, TIER_SOURCES

logger = logging.getLogger(__name__)

#: Operations ``record`` queues before it adds them up itself (a process that no
#: reader asks still holds a bounded queue).
_FOLD_AT = 256

TierStats = list[dict[str, Any]]


@dataclass
class Histogram:
    """Cumulative bucket counts (one per ``LATENCY_BUCKETS`` bound, then +Inf)."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0


@dataclass
class Totals:
    counters: dict[str, float]
    gauges: dict[str, float]
    histograms: dict[str, Histogram]
    tiers: TierStats

    def plain(self) -> dict[str, Any]:
        """Counters, gauges and histograms (count, sum, per-bucket counts) as plain
        data, tiers left out (``lmkv stats`` shows them on their own)."""
        return {"counters": dict(self.counters), "gauges": dict(self.gauges),
                "histograms": {n: {"count": h.count, "sum": h.sum, "counts": list(h.counts)}
                               for n, h in self.histograms.items()}}


class Recorder:
    def __init__(self, *, max_samples: int = 4096, tier_interval_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._hists: dict[str, Histogram] = {}
        self._samples: dict[str, list[float]] = {}  # since the last take (bounded)
        #: Operations recorded, not added up yet (``record``).
        self._pending: deque[tuple[tuple[tuple[str, float], ...], str, float]] = deque()
        self._max_samples = max_samples
        self._taken: dict[str, float] = {}  # counters at the last take
        self._taken_tiers: dict[tuple[int, str, str], float] = {}
        self._sources: list[Callable[[], Callable[[], TierStats] | None]] = []
        self._tier_interval_s = tier_interval_s
        self._tier_cache: tuple[float, TierStats] = (-1e18, [])

    # -- the hot path ----------------------------------------------------------------
    def add(self, name: str, value: float = 1) -> None:
        """Add to a counter of the catalog (KeyError for a name it lacks)."""
        if BY_NAME[name].kind != "counter":
            raise ValueError(f"{name} is a {BY_NAME[name].kind}, not a counter")
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        """One latency sample of a histogram of the catalog."""
        if BY_NAME[name].kind != "histogram":
            raise ValueError(f"{name} is a {BY_NAME[name].kind}, not a histogram")
        with self._lock:
            self._sample_locked(name, seconds)

    def record(self, counters: tuple[tuple[str, float], ...], histogram: str,
               seconds: float) -> None:
        """Several counters and one latency sample of one operation: a lookup, load
        or store (``lmkv.metrics.record``, whose names are the catalog's; unchecked
        here, since this runs once per request). Queued as they come (an append,
        no lock), and added up by the next reader, or once ``_FOLD_AT`` wait."""
        pending = self._pending
        pending.append((counters, histogram, seconds))
        if len(pending) >= _FOLD_AT:
            with self._lock:
                self._fold_locked()

    def _fold_locked(self) -> None:
        """Add up the operations ``record`` queued."""
        pending, totals = self._pending, self._counters
        while pending:  # (every fold holds the lock: what it sees is its own to take)
            counters, histogram, seconds = pending.popleft()
            for name, value in counters:
                totals[name] = totals.get(name, 0) + value
            self._sample_locked(histogram, seconds)

    def _sample_locked(self, name: str, seconds: float) -> None:
        hist = self._hists.get(name)
        if hist is None:
            hist = self._hists[name] = Histogram()
        hist.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        hist.sum += seconds
        hist.count += 1
        samples = self._samples.setdefault(name, [])
        if len(samples) < self._max_samples:
            samples.append(seconds)

    def set_gauge(self, name: str, value: float) -> None:
        if BY_NAME[name].kind != "gauge":
            raise ValueError(f"{name} is a {BY_NAME[name].kind}, not a gauge")
        with self._lock:
            self._gauges[name] = value

    # -- tiers -----------------------------------------------------------------------
    def add_tier_source(self, stats: Callable[[], TierStats]) -> None:
        """Read tier figures from ``stats`` (an engine's ``stats``), held weakly:
        a closed engine drops out by itself."""
        ref: Callable[[], Callable[[], TierStats] | None]
        try:
            ref = weakref.WeakMethod(stats)  # type: ignore[arg-type]
        except TypeError:
            ref = lambda: stats  # noqa: E731 - a plain function: held strongly
        with self._lock:
            self._sources.append(ref)
            self._tier_cache = (-1e18, [])

    def tiers(self) -> TierStats:
        """Every source's tier rows (at most ``tier_interval_s`` old). A source that
        fails is skipped (logged once per failure kind), never raised."""
        now = time.monotonic()
        with self._lock:
            at, rows = self._tier_cache
            if now - at < self._tier_interval_s:
                return rows
            sources = list(self._sources)
        rows, live = [], []
        for ref in sources:
            fn = ref()
            if fn is None:
                continue
            live.append(ref)
            try:
                rows.extend(fn())
            except Exception as exc:  # a closed or unreachable engine: no rows
                logger.debug("lmkv metrics: tier stats failed: %s", exc)
        rows = merge_tier_rows(rows)
        with self._lock:
            self._sources = [r for r in self._sources if r in live or r not in sources]
            self._tier_cache = (now, rows)
        return rows

    # -- readers ---------------------------------------------------------------------
    def totals(self) -> Totals:
        tiers = self.tiers()
        with self._lock:
            self._fold_locked()
            hists = {n: Histogram(list(h.counts), h.sum, h.count) for n, h in self._hists.items()}
            return Totals(dict(self._counters), dict(self._gauges), hists, tiers)

    def take(self, *, tiers: bool = True) -> dict[str, Any]:
        """What changed since the previous ``take``, as plain JSON-able data:
        ``counters`` (deltas), ``samples`` (latencies), ``gauges`` (current) and,
        with ``tiers``, ``tiers``: ``{"<tier>/<type>": {figure: value}}`` with
        counter deltas and gauge values. Empty parts are left out."""
        rows = self.tiers() if tiers else []
        out: dict[str, Any] = {}
        with self._lock:
            self._fold_locked()
            deltas = {}
            for name, value in self._counters.items():
                delta = value - self._taken.get(name, 0)
                if delta:
                    deltas[name] = delta
                    self._taken[name] = value
            if deltas:
                out["counters"] = deltas
            samples = {n: s for n, s in self._samples.items() if s}
            if samples:
                out["samples"] = samples
                self._samples = {}
            if self._gauges:
                out["gauges"] = dict(self._gauges)
            tier_out: dict[str, dict[str, float]] = {}
            for row in rows:
                label = f"{row.get('tier')}/{row.get('type')}"
                figures: dict[str, float] = {}
                for metric, key in TIER_SOURCES.items():
                    value = row.get(key)
                    if not isinstance(value, (int, float)):
                        continue
                    if BY_NAME[metric].kind == "gauge":
                        figures[metric] = value
                        continue
                    mark = (row.get("tier"), str(row.get("type")), metric)
                    delta = value - self._taken_tiers.get(mark, 0)  # type: ignore[arg-type]
                    self._taken_tiers[mark] = value  # type: ignore[index]
                    if delta > 0:
                        figures[metric] = delta
                tier_out[label] = figures
            if tier_out:
                out["tiers"] = tier_out
        return out


_DEFAULT = Recorder()


def merge_tier_rows(rows: TierStats) -> TierStats:
    """One row per (tier, type): the engines of one process (two ``CacheEngine``s,
    say) each report their tier 0, and Prometheus takes one sample per label set.
    Figures add up, except ``available`` (down if any is down) and a capacity of
    None (unbounded if any is)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        mark = (str(row.get("tier")), str(row.get("type")))
        into = merged.get(mark)
        if into is None:
            merged[mark] = dict(row)
            continue
        for name, value in row.items():
            have = into.get(name)
            if name in ("tier", "type"):
                continue
            if name == "available":
                into[name] = min(have if have is not None else 1, value)
            elif value is None or have is None:
                into[name] = None if name in into or value is None else value
            elif isinstance(value, (int, float)) and isinstance(have, (int, float)):
                into[name] = have + value
    return list(merged.values())


def recorder() -> Recorder:
    """The process's recorder (every engine and integration records here)."""
    return _DEFAULT
