"""Belady's offline optimum and a textbook LRU, as pure simulations over chunk ids.

Neither goes through tiers: they are the yardsticks the real replay is measured
against. Both count hits as the replay does, by strict prefix: per request the
leading chunks found are hits, everything from the first chunk not found on is
a miss, and then the request's missed chunks are stored (a chunk found behind
the first miss stays where it is, untouched).

Belady (MIN): whenever a chunk must go, the stored chunk whose next request lies
furthest in the future goes, over the chunk accesses in request order. The chunk
being stored is a candidate too: storing it and evicting it at once is not
storing it (MIN's bypass), which is what the optimum does with a chunk nobody
asks for again before everything else that is stored.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

NEVER = 1 << 62  # the "next use" of a chunk that is never requested again


def next_uses(requests: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each chunk access (request ``r``, position ``i``), the access index of the
    same chunk's next request (``NEVER`` if none). Access indices number every chunk
    of every request in order; one backward pass."""
    total = sum(len(r) for r in requests)
    last: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(requests)
    position = total
    for r in range(len(requests) - 1, -1, -1):
        request = requests[r]
        position -= len(request)
        row = [0] * len(request)
        for i in range(len(request) - 1, -1, -1):
            chunk = request[i]
            row[i] = last.get(chunk, NEVER)
            last[chunk] = position + i
        out[r] = row
    return out


def belady_hits(requests: Sequence[Sequence[int]], capacity: int,
                uses: Sequence[Sequence[int]] | None = None) -> int:
    """Chunks reused (strict prefix) when the cache of ``capacity`` chunks evicts
    as Belady's MIN does. A max-heap of (next use, chunk) with lazy deletion:
    an entry is live while the chunk is stored with that next use. ``uses``:
    ``next_uses(requests)``, when the caller has it already."""
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    if uses is None:
        uses = next_uses(requests)
    stored: dict[int, int] = {}  # chunk -> its next use, while stored
    heap: list[tuple[int, int]] = []  # (-next use, chunk)
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for request, row in zip(requests, uses, strict=True):
        n = len(request)
        prefix = 0
        while prefix < n and request[prefix] in stored:
            prefix += 1
        hits += prefix
        for i in range(n):  # every chunk of the request was requested now
            chunk = request[i]
            if i < prefix or chunk in stored:
                if stored.get(chunk) is not None:
                    stored[chunk] = row[i]
                    push(heap, (-row[i], chunk))
                continue
            if len(stored) >= capacity:
                # The furthest stored chunk, unless the new one is further still.
                while True:
                    far, victim = heap[0]
                    if stored.get(victim) == -far:
                        break
                    pop(heap)
                if -far <= row[i]:
                    continue  # bypass: the new chunk is the one that would go
                pop(heap)
                del stored[victim]
            stored[chunk] = row[i]
            push(heap, (-row[i], chunk))
        if len(heap) > 4 * capacity + 64:  # drop the dead entries now and then
            heap = [(-u, c) for c, u in stored.items()]
            heapq.heapify(heap)
    return hits


def lru_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Chunks reused (strict prefix) by a textbook LRU of ``capacity`` chunks: the
    hit prefix is touched, the missed chunks stored (most recent last)."""
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request in requests:
        n = len(request)
        prefix = 0
        while prefix < n and request[prefix] in cache:
            cache.move_to_end(request[prefix])
            prefix += 1
        hits += prefix
        for chunk in request[prefix:]:
            if chunk in cache:
                continue
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[chunk] = None
    return hits
