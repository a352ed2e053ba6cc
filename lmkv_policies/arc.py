"""``arc``: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), over leaves.

Stored keys are in T1 (seen once: stored, never read since) or T2 (read at
least once, or stored again after it was evicted recently). Evicted keys leave
a ghost in B1 or B2 (the key only, no data). A store that hits a ghost in B1
says T1 is too small: the target size ``p`` of T1 grows; a hit in B2 shrinks
it. An eviction takes the least recent leaf of T1 while T1 holds more than
``p`` entries, else of T2.

Sizes are in entries, as chunks are uniform. The tier does not tell a policy
its capacity in entries: ``c`` is the most entries the tier has held at once,
which is its capacity once it has filled (before that nothing is evicted and
the ghosts are bounded by what was stored). The ghosts are bounded as ARC
bounds them: T1 + B1 <= c and T1 + T2 + B1 + B2 <= 2c, so memory per stored
entry is bounded; ``p`` stays within [0, c].

Differences from the paper, because a tier evicts before the store it makes
room for (it does not know the incoming key): the list to evict from is
chosen by ``len(T1) > p`` alone, and ``p`` adapts when the ghost-hit key is
stored. A remove that is not an eviction (``remove``, ``clear``) leaves a
ghost too. Prefix-aware: only leaves are in T1 and T2's orders; a key that
gains a stored extension is parked (still counted in its list) and goes back
to the most recent end of its list when its last extension leaves: a prompt
that lost its tail keeps the rest for a while, and the next evictions trim
other prompts first (on the Mooncake trace this keeps 1-4 points more hits
than sending the parent to the least recent end, which empties one prompt
after the other).

It orders a tier's slots where the tier numbers its keys (``orders_slots``):
T1 and T2 by slot, the ghosts by a name that outlives the slot
(``ghost_name``), as a slot is reused for another key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from lmkv.contracts.plugin import OptionsArg
from lmkv.contracts.policy import EvictionContext, EvictionPolicy
from lmkv_policies.ghosts import ghost_name, same_name

T1, T2 = 1, 2


class ARCPolicy(EvictionPolicy):
    name = "arc"
    api_version = "2.1"
    orders_slots = True

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        #: Which list each stored key is in (leaves and parked keys alike).
        self._list: dict[Hashable, int] = {}
        #: Leaves of T1 / T2, least recent first.
        self._leaves = {T1: OrderedDict[Hashable, None](), T2: OrderedDict[Hashable, None]()}
        self._sizes = {T1: 0, T2: 0}  # stored keys per list, parked ones included
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0  # target size of T1, in entries
        self.c = 0  # the most entries stored at once
        #: What a key that left is remembered by (its slot's key, by slot).
        self._name: Callable[[Any], Hashable] = same_name

    def use_slots(self) -> None:
        self._name = ghost_name(self)

    # -- hooks -----------------------------------------------------------------
    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        b1, b2 = self._b1, self._b2
        name = self._name(key) if b1 or b2 else None
        if name is not None and name in b1:  # evicted after one use: recency deserves more room
            self.p = min(float(self.c), self.p + max(1.0, len(b2) / len(b1)))
            del b1[name]
            where = T2
        elif name is not None and name in b2:  # evicted after several uses: frequency
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))  # deserves more room
            del b2[name]
            where = T2
        else:
            where = T1
        self._list[key] = where
        self._sizes[where] += 1
        if self.lineage.is_leaf(key):
            self._leaves[where][key] = None
        stored = len(self._list)
        if stored > self.c:
            self.c = stored

    def on_access(self, key: Hashable) -> None:
        where = self._list.get(key)
        if where is None:
            return
        leaves = self._leaves
        if where == T1:
            self._list[key] = T2
            self._sizes[T1] -= 1
            self._sizes[T2] += 1
            if key in leaves[T1]:  # a leaf: to T2's most recent end; parked: stays so
                del leaves[T1][key]
                leaves[T2][key] = None
        elif key in leaves[T2]:
            leaves[T2].move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        where = self._drop(key)
        if where is None:
            return
        ghosts = self._b1 if where == T1 else self._b2
        ghosts[self._name(key)] = None
        self._trim()

    def on_extended(self, key: Hashable) -> None:
        where = self._list.get(key)
        if where is not None:
            self._leaves[where].pop(key, None)

    def on_leaf(self, key: Hashable) -> None:
        where = self._list.get(key)
        if where is not None:  # the most recent end: see the module's docstring
            self._leaves[where][key] = None

    def victims(self) -> Iterator[Hashable]:
        t1, t2 = self._leaves[T1], self._leaves[T2]
        if self._sizes[T1] > self.p or not t2:
            first, second = t1, t2
        else:
            first, second = t2, t1
        if not second:
            return iter(first)
        return (key for leaves in (first, second) for key in leaves)

    # -- bookkeeping -------------------------------------------------------------
    def _drop(self, key: Hashable) -> int | None:
        where = self._list.pop(key, None)
        if where is not None:
            self._sizes[where] -= 1
            self._leaves[where].pop(key, None)
        return where

    def _trim(self) -> None:
        """Bound the ghosts as ARC does: T1 + B1 <= c, all four lists <= 2c."""
        c, b1, b2 = self.c, self._b1, self._b2
        while b1 and self._sizes[T1] + len(b1) > c:
            b1.popitem(last=False)
        while (b1 or b2) and len(self._list) + len(b1) + len(b2) > 2 * c:
            (b2 if b2 else b1).popitem(last=False)

    def ghosts(self) -> int:
        """Keys remembered in B1 and B2."""
        return len(self._b1) + len(self._b2)

    def __len__(self) -> int:
        return len(self._list)
