"""Timing helpers shared by the benchmark scripts (run them as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], rounds: int, *, warm_up: bool = True,
            setup: Callable[[], object] | None = None) -> float:
    """The fastest of ``rounds`` timed calls of ``fn``; ``setup`` runs untimed before each."""
    if warm_up:
        if setup:
            setup()
        fn()  # touches memory, fills caches
    times = []
    for _ in range(rounds):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved_times(cases: list[tuple[Callable[[], object], Callable[[], object] | None]],
                      rounds: int) -> list[list[float]]:
    """Every timed call of each ``(fn, setup)``: ``rounds`` rounds of a call of each in
    turn (after one warm-up round), for ratios taken within a round."""
    times: list[list[float]] = [[] for _ in cases]
    for r in range(rounds + 1):
        for i, (fn, setup) in enumerate(cases):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            if r:
                times[i].append(time.perf_counter() - t0)
    return times
