"""What the cpu tier's arena prefault costs the threads beside it.

A read from a lower tier allocates chunk buffers in a fresh part of the arena
and fills them; the prefault thread (``prefault_ahead``) faults the pages past
them in at the same time. This script plays such reads, 16 chunks of 4 MiB
each (a 4096-token float32 prefix of the vLLM benchmark's model), one after
another into one arena, while a ticker thread stands for the engine's and the
lookup's other Python threads: it wakes every 0.5 ms and records how late it
woke at worst (the GIL held elsewhere).

It prints, per series, the median read (allocate + fill), the ticker's
lateness (the median over the reads of each read's worst, and the worst of
all), and the ratios against the same reads with the prefault off
(``prefault_ahead: 0``, the pages faulted in by the copy itself) from the same
run. ``lmkv.memory._MADVISE`` faults pages in without the GIL; ``mmap.madvise``,
which lmkv used before (up to 77f5e97), held it for each 8 MiB step: run this
script at that commit for the figures before (docs/benchmarks.md has both).

    python benchmarks/bench_prefault.py
    python benchmarks/bench_prefault.py --reads 40
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import torch

from lmkv.memory import MemoryAllocator

CHUNK_BYTES = 4 << 20
CHUNKS_PER_READ = 16
AHEAD = 128 << 20  # the cpu tier's default for a 2 GiB arena (max_bytes / 16)
TICK_S = 0.0005


class Ticker:
    """A thread that wakes every ``TICK_S`` to run a little Python; ``worst`` is the
    longest it woke late (seconds): the GIL held by another thread meanwhile."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(TICK_S)
            self.worst = max(self.worst, time.perf_counter() - t0 - TICK_S)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def series(reads: int, ahead: int) -> dict[str, float]:
    """Reads into a fresh arena with ``prefault_ahead=ahead``: median read ms, and the
    longest ticker stall over each read (median and worst, ms)."""
    read_bytes = CHUNK_BYTES * CHUNKS_PER_READ
    arena = MemoryAllocator(read_bytes * (reads + 1) + 2 * ahead, pin_memory=False,
                            prefault_ahead=ahead)
    source = np.random.default_rng(0).integers(0, 255, CHUNK_BYTES, dtype=np.uint8)
    times, stalls, kept = [], [], []
    for _ in range(reads):
        with Ticker() as ticker:
            t0 = time.perf_counter()
            for _ in range(CHUNKS_PER_READ):
                obj = arena.allocate((CHUNK_BYTES,), torch.uint8)
                assert obj is not None
                obj.tensor.numpy()[:] = source  # numpy: no OpenMP threads
                kept.append(obj)
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)  # the rest of the request: the prefault thread catches up
        stalls.append(ticker.worst)
    if arena.prefaulter is not None and not arena.prefaulter.wait(30):
        raise SystemExit("the prefault thread did not finish in 30 s")
    for obj in kept:
        obj.ref_down()
    return {"read": statistics.median(times) * 1e3,
            "stall_median": statistics.median(stalls) * 1e3,
            "stall_worst": max(stalls) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args()
    off = series(args.reads, 0)
    on = series(args.reads, AHEAD)
    mib = CHUNK_BYTES * CHUNKS_PER_READ >> 20
    print(f"{args.reads} reads of {CHUNKS_PER_READ} x {CHUNK_BYTES >> 20} MiB ({mib} MiB) "
          "into a fresh arena; ms, medians unless said")
    print(f"{'prefault_ahead':<16} {'read':>8} {'late, median':>13} {'late, worst':>12}")
    for name, row in (("0 (baseline)", off), (f"{AHEAD >> 20} MiB", on)):
        print(f"{name:<16} {row['read']:8.1f} {row['stall_median']:13.1f} "
              f"{row['stall_worst']:12.1f}")
    print(f"read with the prefault / without: {on['read'] / off['read']:.2f}; "
          f"worst lateness with / without: "
          f"{on['stall_worst'] / max(off['stall_worst'], 1e-3):.2f}")


if __name__ == "__main__":
    main()
