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
from collections.abc import Hashable, Iterator, Sequence
from itertools import count

from lmkv.contracts.plugin import OptionsArg
from lmkv.contracts.policy import EvictionContext, EvictionPolicy, SlotLineage
from lmkv_policies.lru_slots import SlotRecency, merged


class LRUPolicy(EvictionPolicy):
    name = "lru"
    api_version = "2.2"
    orders_slots = True

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
        #: The order of a tier's slots, in arrays (``use_slots``); None: by key.
        self._slot_order: SlotRecency | None = None

    def use_slots(self) -> None:
        assert isinstance(self.lineage, SlotLineage)
        order = self._slot_order = SlotRecency(self.lineage, self._clock)
        # The base calls the hooks for every chunk stored, read or dropped: bound
        # straight to the arrays' order, they skip a call each (the methods below
        # dispatch the same way for whoever calls them on the class). A hook a
        # subclass replaced stays its own.
        for hook, bound in (("on_insert", order.insert), ("on_access", order.access),
                            ("on_remove", order.remove), ("on_extended", order.extended),
                            ("on_leaf", order.leaf)):
            if getattr(type(self), hook) is getattr(LRUPolicy, hook):
                setattr(self, hook, bound)

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        if self._slot_order is not None:
            self._slot_order.insert(key, parent)  # type: ignore[arg-type]
            return
        if self.lineage.is_leaf(key):  # a new key: the base forgot a stored one first
            self._order[key] = next(self._clock)
        else:  # a key that extends it was stored first
            self._parked[key] = next(self._clock)

    def on_insert_many(self, keys: list[Hashable], parents: list[Hashable | None]) -> None:
        # (called for slots only: a batch whose lineage is in place)
        assert self._slot_order is not None
        self._slot_order.insert_many(keys, parents)  # type: ignore[arg-type]

    def on_access_many(self, keys: Sequence[Hashable]) -> None:
        if self._slot_order is not None:
            self._slot_order.access_many(keys)  # type: ignore[arg-type]
            return
        for key in keys:
            self.on_access(key)

    def on_access(self, key: Hashable) -> None:
        if self._slot_order is not None:
            self._slot_order.access(key)  # type: ignore[arg-type]
            return
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
        if self._slot_order is not None:
            self._slot_order.remove(key)  # type: ignore[arg-type]
            return
        if self._order.pop(key, None) is None and self._parked.pop(key, None) is None:
            self._back.pop(key, None)

    def on_extended(self, key: Hashable) -> None:
        if self._slot_order is not None:
            self._slot_order.extended(key)  # type: ignore[arg-type]
            return
        used = self._order.pop(key, None)
        if used is None:
            used = self._back.pop(key, None)
        if used is not None:
            self._parked[key] = used

    def on_leaf(self, key: Hashable) -> None:
        if self._slot_order is not None:
            self._slot_order.leaf(key)  # type: ignore[arg-type]
            return
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
        if self._slot_order is not None:
            return self._slot_order.victims()
        if not self._back:
            if self._heap:
                self._heap.clear()
            return iter(self._order)
        return self._merged()

    def _merged(self) -> Iterator[Hashable]:
        """``_order`` and the heap's live items, least recent first."""
        return merged(self._order.items(), self._heap, self._back)

    def __len__(self) -> int:
        if self._slot_order is not None:
            return len(self._slot_order)
        return len(self._order) + len(self._parked) + len(self._back)
