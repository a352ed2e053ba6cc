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
        [--policies lru,lfu,arc,s3fifo] [--admit-after N]
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

from lmkv.admission import AdmissionGate
from lmkv.plugins.manager import get_plugin_manager


def load(path: str) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def belady(requests: list[list[int]], capacity: int) -> float:
    seq = [h for r in requests for h in r]
    following = [0] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        following[i] = last.get(seq[i], 1 << 62)
        last[seq[i]] = i
    stored: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = pos = 0
    for request in requests:
        prefix = True
        for block in request:
            nxt = following[pos]
            pos += 1
            if block in stored:
                hits += prefix
            else:
                prefix = False
                if len(stored) >= capacity:
                    while stored.get(heap[0][1]) != -heap[0][0]:
                        heapq.heappop(heap)  # stale
                    if -heap[0][0] <= nxt:
                        continue  # the incoming block is the one used furthest ahead
                    del stored[heapq.heappop(heap)[1]]
            stored[block] = nxt
            heapq.heappush(heap, (-nxt, block))
    return hits / len(seq)


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
    args = parser.parse_args()
    requests = load(args.trace)
    unique = len({h for r in requests for h in r})
    manager = get_plugin_manager()
    print(f"[hits] {len(requests)} requests, {unique} unique blocks, "
          f"admit_after {args.admit_after}")
    for share in args.capacity.split(","):
        capacity = max(1, int(unique * float(share.rstrip("%")) / 100))
        best = belady(requests, capacity)
        print(f"  {share} ({capacity} blocks) belady: {best:.3f}")
        for name in args.policies.split(","):
            policy = manager.eviction_policy(name)()
            ratio, speed = replay(requests, capacity, policy, args.admit_after)
            print(f"  {share} ({capacity} blocks) {name}: {ratio:.3f}  ({ratio / best:.2f} of "
                  f"belady; {speed:,.0f} chunk ops/s)")


if __name__ == "__main__":
    main()
