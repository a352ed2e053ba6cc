"""Copies out of the lmkv server's shared arena: 4 KiB pages (/dev/shm) against
huge pages (memfd_create(MFD_HUGETLB)), in one run.

    python benchmarks/bench_shm_pages.py             # 64 MiB, best of 30 copies each
    python benchmarks/bench_shm_pages.py --mib 256 --rounds 10

This process creates both arenas as the lmkv server does and fills them; a
child process maps them as a client does (by the names the server hands out)
and copies out of them what a client's load copies: ``--mib`` of the arena
into an ordinary tensor that is already faulted in, warm (a long-lived client
maps the arena once), alternating between the two arenas so that load from
other jobs hits both alike. Huge pages need a reservation on the host
(``sysctl vm.nr_hugepages=N``, docs/server.md); without enough of them this
prints the setting and measures 4 KiB pages only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from lmkv.memory.shm import HUGE_PAGES_SETTING, SharedSegment, huge_pages

MiB = 1 << 20


def client(names: list[str], size: int, rounds: int) -> None:
    """The child: the best copy time out of each named arena, alternating."""
    segments = [SharedSegment.attach(name, size) for name in names]
    target = torch.zeros(size, dtype=torch.uint8)
    best = [float("inf")] * len(segments)
    for _ in range(rounds + 1):  # the first copy of each warms the mapping up
        for i, segment in enumerate(segments):
            t0 = time.perf_counter()
            target.copy_(segment.tensor[:size])
            best[i] = min(best[i], time.perf_counter() - t0)
            if not torch.equal(target[:4096], segment.tensor[:4096]):
                sys.exit("a copy differs from its arena")
    print(" ".join(f"{size / seconds / 1e9:.3f}" for seconds in best))


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
        rates = [float(x) for x in out]
    finally:
        for segment in segments:
            segment.close()
    print(f"4 KiB pages: {rates[0]:6.2f} GB/s  (/dev/shm, {args.mib} MiB, best of {args.rounds})")
    if len(segments) < 2 or not segments[1].huge_pages:
        have = max(pages.available, 0) if pages else 0
        print(f"huge pages: {have} available, {needed} needed: reserve them with "
              f"`{HUGE_PAGES_SETTING}={(pages.total if pages else 0) + needed - have}` "
              f"(as root) and run again")
        return
    print(f"huge pages:  {rates[1]:6.2f} GB/s  ({segments[1].page_size >> 20} MiB pages, memfd)")
    print(f"ratio huge / 4 KiB: {rates[1] / rates[0]:.2f}")


if __name__ == "__main__":
    main()
