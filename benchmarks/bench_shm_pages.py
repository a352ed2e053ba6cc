"""Copies out of the lmkv server's shared arena: 4 KiB pages (/dev/shm) against
huge pages (memfd_create(MFD_HUGETLB)), in one run.

    python benchmarks/bench_shm_pages.py             # 64 MiB, 30 copies each
    python benchmarks/bench_shm_pages.py --mib 256 --rounds 10

This process creates both arenas as the lmkv server does and fills them; a
child process maps them as a client does (by the names the server hands out)
and copies out of them what a client's load copies: ``--mib`` of the arena
into an ordinary tensor that is already faulted in, alternating between the
two arenas so that load from other jobs hits both alike. Two figures each: the
first copy after mapping (best of 6 fresh mappings: the client's page tables
are filled as it reads, one fault per page, what a fresh client or arena bytes
it never touched cost) and warm
copies (best of ``--rounds``, and the median of each round's ratio). Huge
pages need a reservation on the host (``sysctl vm.nr_hugepages=N``,
docs/server.md); without enough of them this prints the setting and measures
4 KiB pages only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from lmkv.memory.shm import HUGE_PAGES_SETTING, SharedSegment, huge_pages

MiB = 1 << 20
COLD_ROUNDS = 6  # fresh mappings per arena for the first-copy figure


def client(names: list[str], size: int, rounds: int) -> None:
    """The child: for each named arena, the best first copy after mapping it (of
    ``COLD_ROUNDS`` fresh mappings), the best warm copy, and the median over
    rounds of each round's time ratio (first arena / each). Arenas alternate
    within a round, and a ratio taken within one round cancels the slow swings
    of a machine shared with other jobs."""
    target = torch.zeros(size, dtype=torch.uint8)
    target.copy_(torch.ones(size, dtype=torch.uint8))  # torch's threads are up
    cold: list[list[float]] = [[] for _ in names]
    for round_ in range(COLD_ROUNDS):
        order = list(enumerate(names))
        for i, name in order if round_ % 2 else order[::-1]:
            segment = SharedSegment.attach(name, size)
            t0 = time.perf_counter()
            target.copy_(segment.tensor[:size])
            cold[i].append(time.perf_counter() - t0)
            segment.close()
    segments = [SharedSegment.attach(name, size) for name in names]
    times: list[list[float]] = [[] for _ in segments]
    for round_ in range(rounds + 1):
        for i, segment in enumerate(segments):
            t0 = time.perf_counter()
            target.copy_(segment.tensor[:size])
            if round_:  # the first round fills the page tables
                times[i].append(time.perf_counter() - t0)
            if not torch.equal(target[:4096], segment.tensor[:4096]):
                sys.exit("a copy differs from its arena")
    ratios = [statistics.median(a / b for a, b in zip(times[0], t, strict=True))
              for t in times]
    print(" ".join(f"{size / min(t) / 1e9:.3f}" for t in times),
          " ".join(f"{size / min(t) / 1e9:.3f}" for t in cold),
          " ".join(f"{r:.3f}" for r in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="bytes copied, MiB (64)")
    parser.add_argument("--rounds", type=int, default=30, help="timed copies, best kept (30)")
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mib * MiB
    if args.client:
        client(args.client, size, args.rounds)
        return
    segments = [SharedSegment.create(size, huge_pages=False)]
    pages = huge_pages()
    needed = -(-size // pages.page_size) if pages else 0
    if pages is not None and pages.available >= needed:
        segments.append(SharedSegment.create(size))
    try:
        for segment in segments:
            segment.tensor[:size].copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        out = subprocess.run(
            [sys.executable, __file__, "--mib", str(args.mib), "--rounds", str(args.rounds),
             "--client", *(s.name for s in segments)],
            check=True, capture_output=True, text=True, env=os.environ).stdout.split()
        n = len(segments)
        rates = [float(x) for x in out[:n]]
        cold = [float(x) for x in out[n:2 * n]]  # first copies after mapping, best
        ratio = float(out[-1])  # huge / 4 KiB, the median of the rounds' ratios
    finally:
        for segment in segments:
            segment.close()
    print(f"4 KiB pages: {rates[0]:6.2f} GB/s  (/dev/shm, {args.mib} MiB, best of {args.rounds}); "
          f"first copy after mapping: {cold[0]:.2f} GB/s")
    if len(segments) < 2 or not segments[1].huge_pages:
        have = max(pages.available, 0) if pages else 0
        print(f"huge pages: {have} available, {needed} needed: reserve them with "
              f"`{HUGE_PAGES_SETTING}={(pages.total if pages else 0) + needed - have}` "
              f"(as root) and run again")
        return
    print(f"huge pages:  {rates[1]:6.2f} GB/s  ({segments[1].page_size >> 20} MiB pages, memfd); "
          f"first copy after mapping: {cold[1]:.2f} GB/s")
    print(f"ratio huge / 4 KiB, warm: {rates[1] / rates[0]:.2f} (best against best), "
          f"{ratio:.2f} (median of the rounds' ratios); first copy after mapping: "
          f"{cold[1] / cold[0]:.2f}")


if __name__ == "__main__":
    main()
