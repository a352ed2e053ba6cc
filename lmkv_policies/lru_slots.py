"""``lru``'s order of a tier's slots, in arrays (``EvictionPolicy.order_slots``).

The same order as ``LRUPolicy`` keeps in dicts, step for step: leaves in a
doubly linked list by last use (``prev``/``next``), parked keys with their
last use, and the few leaves back from parking whose last use falls inside
the list in a dict and a heap. Per slot: a state byte, a last use and two
links, 17 bytes; nothing per key on the Python heap.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import count, repeat
from typing import TypeVar

from lmkv.contracts.policy import SlotLineage

_NONE, _ORDER, _PARKED, _BACK = 0, 1, 2, 3
_T = TypeVar("_T")


class SlotRecency:
    """Leaves in recency order, parked slots and slots back from parking."""

    def __init__(self, lineage: SlotLineage, clock: count) -> None:
        self.lineage = lineage
        self._clock = clock
        self._state = array("b")
        self._used = array("q")
        self._prev = array("i")
        self._next = array("i")
        self._head = self._tail = -1  # least and most recent leaf
        self._ordered = 0
        self._parked = 0
        self._back: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []

    def _reach(self, slot: int) -> None:
        size = len(self._state)
        if slot >= size:
            more = max(slot + 1 - size, size >> 3, 1024)
            self._state.extend(repeat(_NONE, more))
            self._used.extend(repeat(0, more))
            self._prev.extend(repeat(-1, more))
            self._next.extend(repeat(-1, more))

    def _append(self, slot: int, used: int) -> None:
        self._used[slot] = used
        self._state[slot] = _ORDER
        self._prev[slot], self._next[slot] = self._tail, -1
        if self._tail >= 0:
            self._next[self._tail] = slot
        else:
            self._head = slot
        self._tail = slot
        self._ordered += 1

    def _prepend(self, slot: int, used: int) -> None:
        self._used[slot] = used
        self._state[slot] = _ORDER
        self._prev[slot], self._next[slot] = -1, self._head
        if self._head >= 0:
            self._prev[self._head] = slot
        else:
            self._tail = slot
        self._head = slot
        self._ordered += 1

    def _unlink(self, slot: int) -> None:
        before, after = self._prev[slot], self._next[slot]
        if before >= 0:
            self._next[before] = after
        else:
            self._head = after
        if after >= 0:
            self._prev[after] = before
        else:
            self._tail = before
        self._state[slot] = _NONE
        self._ordered -= 1

    def insert(self, slot: int, parent: int | None = None) -> None:
        if slot >= len(self._state):
            self._reach(slot)
        if not self.lineage._children[slot]:  # a leaf (the usual case): to the tail
            tail = self._tail
            self._used[slot] = next(self._clock)
            self._state[slot] = _ORDER
            self._prev[slot] = tail
            self._next[slot] = -1
            if tail >= 0:
                self._next[tail] = slot
            else:
                self._head = slot
            self._tail = slot
            self._ordered += 1
        else:  # a slot that extends it was stored first
            self._used[slot] = next(self._clock)
            self._state[slot] = _PARKED
            self._parked += 1

    def insert_many(self, slots: list[int], parents: list[int | None]) -> None:
        """``insert`` of each slot, the lineage already holding all of them: what
        ``extended`` and ``insert`` slot by slot would leave (a slot that a later
        one extends goes straight to parked, where it would have gone)."""
        state = self._state
        top = max(slots)
        if top >= len(state):
            self._reach(top)
            state = self._state
        for parent in parents:  # stored leaves before the batch, extended now
            if parent is not None and parent < len(state) and state[parent] in (_ORDER, _BACK):
                self.extended(parent)
        children, used, prevs, nexts = (self.lineage._children, self._used, self._prev,
                                        self._next)
        clock, tail, ordered, parked = self._clock, self._tail, 0, 0
        for slot in slots:
            used[slot] = next(clock)
            if children[slot]:  # a slot that extends it is stored
                state[slot] = _PARKED
                parked += 1
            else:  # a leaf: to the tail
                state[slot] = _ORDER
                prevs[slot] = tail
                nexts[slot] = -1
                if tail >= 0:
                    nexts[tail] = slot
                else:
                    self._head = slot
                tail = slot
                ordered += 1
        self._tail = tail
        self._ordered += ordered
        self._parked += parked

    def access_many(self, slots: Sequence[int]) -> None:
        """``access`` of each slot (a prompt's inner chunks, parked, in one pass)."""
        state, used, clock = self._state, self._used, self._clock
        prevs, nexts = self._prev, self._next
        size = len(state)
        for slot in slots:
            found = state[slot] if slot < size else _NONE
            if found == _PARKED:
                used[slot] = next(clock)
            elif found == _ORDER:  # to the tail (``access``, inlined)
                used[slot] = next(clock)
                tail = self._tail
                if slot == tail:
                    continue
                before, after = prevs[slot], nexts[slot]
                if before >= 0:
                    nexts[before] = after
                else:
                    self._head = after
                prevs[after] = before
                prevs[slot], nexts[slot] = tail, -1
                nexts[tail] = slot
                self._tail = slot
            else:
                self.access(slot)

    def access(self, slot: int) -> None:
        state = self._state[slot] if slot < len(self._state) else _NONE
        if state == _PARKED:
            self._used[slot] = next(self._clock)
        elif state == _ORDER:
            self._used[slot] = next(self._clock)
            tail = self._tail
            if slot == tail:
                return  # the most recent already
            before, after = self._prev[slot], self._next[slot]
            nexts, prevs = self._next, self._prev
            if before >= 0:  # unlink (it has a successor: it is not the tail) ...
                nexts[before] = after
            else:
                self._head = after
            prevs[after] = before
            prevs[slot], nexts[slot] = tail, -1  # ... and append
            nexts[tail] = slot
            self._tail = slot
        elif state == _BACK:
            del self._back[slot]
            self._append(slot, next(self._clock))

    def remove(self, slot: int) -> None:
        state = self._state[slot] if slot < len(self._state) else _NONE
        if state == _ORDER:
            self._unlink(slot)
        elif state == _PARKED:
            self._parked -= 1
        elif state == _BACK:
            del self._back[slot]
        if state != _NONE:
            self._state[slot] = _NONE

    def extended(self, slot: int) -> None:
        state = self._state[slot] if slot < len(self._state) else _NONE
        if state == _ORDER:
            self._unlink(slot)
        elif state == _BACK:
            self._used[slot] = self._back.pop(slot)
        else:
            return
        self._state[slot] = _PARKED
        self._parked += 1

    def leaf(self, slot: int) -> None:
        if slot >= len(self._state) or self._state[slot] != _PARKED:
            return
        self._parked -= 1
        used = self._used[slot]
        if self._head >= 0 and used < self._used[self._head]:
            self._prepend(slot, used)  # the least recent leaf: the usual case
        elif self._head < 0 or used > self._used[self._tail]:
            self._append(slot, used)  # the most recent leaf
        else:
            self._state[slot] = _BACK
            self._back[slot] = used
            heapq.heappush(self._heap, (used, slot))
            if len(self._heap) > 2 * len(self._back) + 64:  # drop stale items
                self._heap = [(u, s) for s, u in self._back.items()]
                heapq.heapify(self._heap)

    def victims(self) -> Iterator[int]:
        if not self._back:
            if self._heap:
                self._heap.clear()
            return self._chain()
        return self._merged()

    def _chain(self) -> Iterator[int]:
        after, slot = self._next, self._head
        while slot >= 0:
            following = after[slot]
            yield slot
            slot = following

    def _merged(self) -> Iterator[int]:
        used = self._used
        return merged(((slot, used[slot]) for slot in self._chain()), self._heap, self._back)

    def __len__(self) -> int:
        return self._ordered + self._parked + len(self._back)


def merged(leaves: Iterable[tuple[_T, int]], heap: list[tuple[int, _T]],
           back: dict[_T, int]) -> Iterator[_T]:
    """``leaves`` (each with its last use, least recent first) and the heap's live
    items (those ``back`` still maps to the use they were pushed with), merged
    least recent first, each once."""
    seen: set[_T] = set()
    heap_items = in_order(heap)
    pending = next(heap_items, None)
    for leaf, used in leaves:
        while pending is not None and pending[0] < used:
            if back.get(pending[1]) == pending[0] and pending[1] not in seen:
                seen.add(pending[1])
                yield pending[1]
            pending = next(heap_items, None)
        yield leaf
    while pending is not None:
        if back.get(pending[1]) == pending[0] and pending[1] not in seen:
            seen.add(pending[1])
            yield pending[1]
        pending = next(heap_items, None)


def in_order(heap: list[tuple[int, _T]]) -> Iterator[tuple[int, _T]]:
    """A binary heap's items in ascending order without changing it."""
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
