"""Hit ratio of every eviction policy on a Mooncake-style trace, against Belady.

A quick check of the policies alone (no tier, no payloads; ``lmkv replay`` runs
traces through the real storage manager). Each line of the trace is a JSON
object with ``hash_ids`` (one id per block; an id names its whole prefix, as
Mooncake's do). Requests run in order: the stored prefix is a hit (strict
prefix) and is read, the rest is stored with its parents, evicting leaves in
the policy's order (never the request's own prefix, which it is reading).
Capacities are shares of the trace's unique blocks. Belady: whenever a block
must go, the stored block whose next request lies furthest ahead goes (the
incoming block itself when it is that one), over the block accesses in
request order.

    python benchmarks/bench_policy_hits.py TRACE.jsonl [--capacity 5%,10%,20%]
        [--policies lru,lfu,arc,s3fifo] [--admit-after N] [--bounds]

``--bounds`` adds two caches that know part of the future, between the online
policies and Belady: LRU behind a perfect filter (a block never requested again
is not stored), and a perfect LFU (the leaf with the fewest requests still to
come goes). They bound what any online policy can hope for on the trace.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

from lmkv.plugins.manager import get_plugin_manager
from lmkv.replay.belady import belady_hits
from lmkv.storage.admission import AdmissionGate


def load(path: str) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def oracle(requests: list[list[int]], capacity: int, rank: str) -> float:
    """An upper bound no online policy reaches: strict-prefix hits of a cache that
    knows each block's future. It never stores a block that is not requested
    again, and evicts the leaf least recently used (``rank="lru"``: a perfect
    one-hit-wonder filter in front of LRU) or the leaf with the fewest requests
    still to come, least recent first (``rank="remaining"``: a perfect LFU that
    knows what is left). Belady differs from the second by also knowing when."""
    left: dict[int, int] = {}
    for request in requests:
        for block in request:
            left[block] = left.get(block, 0) + 1
    stored: dict[int, tuple[int, int]] = {}  # block -> its rank while stored
    parent: dict[int, int] = {}
    kids: dict[int, int] = {}
    heap: list[tuple[tuple[int, int], int]] = []
    hits = clock = 0
    for request in requests:
        prefix = 0
        while prefix < len(request) and request[prefix] in stored:
            prefix += 1
        hits += prefix
        for i, block in enumerate(request):
            clock += 1
            left[block] -= 1
            order = (0, clock) if rank == "lru" else (left[block], clock)
            if block not in stored and not left[block]:
                continue  # never asked for again: the perfect filter skips it
            if block not in stored and len(stored) >= capacity:
                while True:  # the lowest-ranked leaf (stale heap entries skipped)
                    order_v, victim = heapq.heappop(heap)
                    if stored.get(victim) == order_v and not kids.get(victim):
                        break
                del stored[victim]
                up = parent.pop(victim, None)
                if up is not None:
                    kids[up] -= 1
                    if up in stored and not kids[up]:
                        heapq.heappush(heap, (stored[up], up))
            if block not in stored and i and request[i - 1] in stored:
                parent[block] = request[i - 1]
                kids[request[i - 1]] = kids.get(request[i - 1], 0) + 1
            stored[block] = order
            if not kids.get(block):
                heapq.heappush(heap, (order, block))
        if len(heap) > 8 * capacity:  # drop the stale entries now and then
            heap = [(o, b) for b, o in stored.items()]
            heapq.heapify(heap)
    return hits / sum(len(r) for r in requests)


def replay(requests: list[list[int]], capacity: int, policy, admit_after: int
           ) -> tuple[float, float]:
    """Hit ratio and chunk operations per second."""
    gate = AdmissionGate(admit_after, max_tracked=4 * capacity) if admit_after > 1 else None
    stored: set[int] = set()
    hits = total = 0
    start = time.perf_counter()
    for request in requests:
        h = 0
        while h < len(request) and request[h] in stored:
            h += 1
        hits += h
        total += len(request)
        for block in request[:h]:
            policy.access(block)
        new = request[h:]
        parents = [request[h - 1] if h else None, *new[:-1]][:len(new)]
        if gate is not None:
            new, _, parents, _ = gate.admit(new, new, parents, 1)
        reading = set(request[:h])
        while len(stored) + len(new) > capacity:
            victim = next((k for k in policy.candidates() if k not in reading), None)
            if victim is None:
                break
            policy.forget(victim)
            stored.discard(victim)
        room = max(0, capacity - len(stored))
        for block, parent in zip(new[:room], parents[:room], strict=True):
            policy.insert(block, parent)
            stored.add(block)
    return hits / total, total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity", default="5%,10%,20%")
    parser.add_argument("--policies", default="lru,lfu,arc,s3fifo")
    parser.add_argument("--admit-after", type=int, default=1)
    parser.add_argument("--bounds", action="store_true",
                        help="also two offline bounds that know part of the future")
    args = parser.parse_args()
    requests = load(args.trace)
    unique = len({h for r in requests for h in r})
    manager = get_plugin_manager()
    print(f"[hits] {len(requests)} requests, {unique} unique blocks, "
          f"admit_after {args.admit_after}")
    for share in args.capacity.split(","):
        capacity = max(1, int(unique * float(share.rstrip("%")) / 100))
        best = belady_hits(requests, capacity) / sum(len(r) for r in requests)
        print(f"  {share} ({capacity} blocks) belady: {best:.3f}")
        if args.bounds:
            for rank, what in (("lru", "LRU behind a perfect filter of blocks never reused"),
                               ("remaining", "a perfect LFU of the requests still to come")):
                ratio = oracle(requests, capacity, rank)
                print(f"  {share} ({capacity} blocks) oracle {rank}: {ratio:.3f}  "
                      f"({ratio / best:.2f} of belady; {what})")
        for name in args.policies.split(","):
            policy = manager.eviction_policy(name)()
            ratio, speed = replay(requests, capacity, policy, args.admit_after)
            print(f"  {share} ({capacity} blocks) {name}: {ratio:.3f}  ({ratio / best:.2f} of "
                  f"belady; {speed:,.0f} chunk ops/s)")


if __name__ == "__main__":
    main()
