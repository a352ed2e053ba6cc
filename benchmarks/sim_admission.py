"""Does frequency or admission close the gap to Belady? A pure simulation.

The target for the best built-in eviction policy is 0.6 of Belady's hit ratio on
the Mooncake trace at 5% and 10%; every built-in policy gets about 0.40 / 0.51
(docs/benchmarks.md, trace replay). This simulates, over the trace's chunk ids
and with the replay's strict-prefix hit counting (``lmkv.replay.belady``), a
prefix-aware LFU (leaves only, counts of every sighting), with and without
TinyLFU-style admission (a missed chunk is stored only when seen more often
than the leaf it would evict), and with counts halved every 500 requests::

    python benchmarks/sim_admission.py ../shared/traces/synthetic_trace.jsonl

Each figure is the hit ratio and, in brackets, its fraction of Belady's.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict
from collections.abc import Sequence

from lmkv.replay.belady import belady_hits, lru_hits


def prefix_lfu_hits(requests: Sequence[Sequence[int]], capacity: int, *, admit: bool = True,
                    halve_every: int | None = None) -> int:
    count: dict[int, int] = defaultdict(int)
    parent: dict[int, int] = {}
    children: dict[int, int] = defaultdict(int)
    stored: set[int] = set()
    heap: list[tuple[int, int, int]] = []  # (count, tie, chunk) of leaves, lazily
    tie = hits = 0

    def push(chunk: int) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(heap, (count[chunk], tie, chunk))

    for seen, request in enumerate(requests, 1):
        prefix = 0
        while prefix < len(request) and request[prefix] in stored:
            prefix += 1
        hits += prefix
        for chunk in request:
            count[chunk] += 1
        if halve_every and seen % halve_every == 0:
            for chunk in count:
                count[chunk] //= 2
        for chunk in request[:prefix]:
            if children[chunk] == 0:
                push(chunk)
        prev = request[prefix - 1] if prefix else None
        for chunk in request[prefix:]:
            if chunk in stored:
                prev = chunk
                continue
            if len(stored) >= capacity:
                while True:  # the least counted live leaf (never the chunk stored last)
                    n, _, victim = heap[0]
                    live = victim in stored and children[victim] == 0 and victim != prev
                    if live and n == count[victim]:
                        break
                    heapq.heappop(heap)
                    if live:
                        push(victim)
                if admit and count[chunk] <= n:
                    break  # not admitted: nor is anything after it (strict prefixes)
                heapq.heappop(heap)
                stored.discard(victim)
                up = parent.pop(victim, None)
                if up is not None:
                    children[up] -= 1
                    if children[up] == 0 and up in stored:
                        push(up)
            stored.add(chunk)
            if prev is not None and prev in stored:
                parent[chunk] = prev
                children[prev] += 1
            push(chunk)
            prev = chunk
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Mooncake-format JSONL trace")
    parser.add_argument("--capacity", default="5,10,20", help="percent of the unique chunks")
    args = parser.parse_args()
    with open(args.trace) as f:
        requests = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    total = sum(len(r) for r in requests)
    unique = len({c for r in requests for c in r})
    for percent in (float(p) for p in args.capacity.split(",")):
        capacity = max(1, int(unique * percent / 100))
        best = belady_hits(requests, capacity)
        row = [f"{percent:g}%: Belady {best / total:.3f}"]
        for name, hits in (
                ("textbook LRU", lru_hits(requests, capacity)),
                ("prefix LFU", prefix_lfu_hits(requests, capacity, admit=False)),
                ("prefix LFU + admission", prefix_lfu_hits(requests, capacity)),
                ("... counts halved /500", prefix_lfu_hits(requests, capacity, halve_every=500))):
            row.append(f"{name} {hits / total:.3f} ({hits / best:.2f})")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
