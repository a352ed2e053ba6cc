"""``lru``: evict the least recently stored or read leaf first.

Prefix-aware: only leaves (stored keys that no stored key extends) are in the
recency order; a key that gains a stored extension is parked with its last
use, and goes back into the order when its last extension leaves, at the
place its last use gives it. Lookups read a prompt's chunks head first, so a
parent was used just before its child: when the least recent leaf goes, its
parent is the next least recent and goes to the front, in O(1). A parent read
since (a prompt that ended there) is placed by its last use through a small
heap, so a shared head that is still read stays.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import count

from lmkv.contracts.plugin import OptionsArg
from lmkv.contracts.policy import EvictionContext, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"
    api_version = "2.0"

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        self._clock = count(1)
        #: Leaves in recency order (least recent first), with their last use.
        self._order: OrderedDict[Hashable, int] = OrderedDict()
        #: Stored keys that some stored key extends, with their last use.
        self._parked: dict[Hashable, int] = {}
        #: Leaves back from parking whose last use falls inside ``_order``:
        #: ``_back`` maps them to it, ``_heap`` orders them (with stale items).
        self._back: dict[Hashable, int] = {}
        self._heap: list[tuple[int, Hashable]] = []

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        if self.lineage.is_leaf(key):  # a new key: the base forgot a stored one first
            self._order[key] = next(self._clock)
        else:  # a key that extends it was stored first
            self._parked[key] = next(self._clock)

    def on_access(self, key: Hashable) -> None:
        # A prefix lookup reads a prompt's inner chunks (parked) and one leaf.
        parked, order = self._parked, self._order
        if key in parked:
            parked[key] = next(self._clock)
        elif key in order:
            order[key] = next(self._clock)
            order.move_to_end(key)
        elif key in self._back:
            del self._back[key]
            order[key] = next(self._clock)

    def on_remove(self, key: Hashable) -> None:
        if self._order.pop(key, None) is None and self._parked.pop(key, None) is None:
            self._back.pop(key, None)

    def on_extended(self, key: Hashable) -> None:
        used = self._order.pop(key, None)
        if used is None:
            used = self._back.pop(key, None)
        if used is not None:
            self._parked[key] = used

    def on_leaf(self, key: Hashable) -> None:
        used = self._parked.pop(key, None)
        if used is None:
            return
        order = self._order
        if order and used < next(iter(order.values())):
            order[key] = used
            order.move_to_end(key, last=False)  # the least recent leaf: the usual case
        elif not order or used > next(reversed(order.values())):
            order[key] = used  # the most recent leaf
        else:
            self._back[key] = used
            heapq.heappush(self._heap, (used, key))
            if len(self._heap) > 2 * len(self._back) + 64:  # drop stale items
                self._heap = [(u, k) for k, u in self._back.items()]
                heapq.heapify(self._heap)

    def victims(self) -> Iterator[Hashable]:
        if not self._back:
            if self._heap:
                self._heap.clear()
            return iter(self._order)
        return self._merged()

    def _merged(self) -> Iterator[Hashable]:
        """``_order`` and the heap's live items, least recent first."""
        back, seen = self._back, set()
        heap_items = _in_order(self._heap)
        pending = next(heap_items, None)
        for key, used in self._order.items():
            while pending is not None and pending[0] < used:
                if back.get(pending[1]) == pending[0] and pending[1] not in seen:
                    seen.add(pending[1])
                    yield pending[1]
                pending = next(heap_items, None)
            yield key
        while pending is not None:
            if back.get(pending[1]) == pending[0] and pending[1] not in seen:
                seen.add(pending[1])
                yield pending[1]
            pending = next(heap_items, None)

    def __len__(self) -> int:
        return len(self._order) + len(self._parked) + len(self._back)


def _in_order(heap: list[tuple[int, Hashable]]) -> Iterator[tuple[int, Hashable]]:
    """A binary heap's items in ascending order without changing it: O(k log k)
    for the first k (a frontier of the heap's nodes)."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
