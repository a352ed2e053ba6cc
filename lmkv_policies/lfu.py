"""``lfu``: evict the least frequently used leaf first, with ageing.

Each stored key counts its uses (the store counts one, each read one more, up
to ``max_frequency``). Leaves sit in one bucket per count, least recent first
within a bucket, so an eviction takes the front of the lowest bucket in O(1)
(the buckets are few: counts are capped). Ageing keeps yesterday's hot prompt
from staying forever: every ``decay_period`` uses (0: ten times the entries
stored) every count is multiplied by ``decay_factor`` (rounded down, at least
1), in one pass over the stored keys, so its cost per use is constant.

Prefix-aware: a key that gains a stored extension leaves its bucket and keeps
its count; when its last extension leaves it goes back to the most recent end
of its count's bucket (it is at least as frequent as the leaf that just went;
trimming other prompts before emptying this one keeps more hits on the
Mooncake trace).

It orders a tier's slots where the tier numbers its keys (``orders_slots``):
counts and buckets by slot, and the counts of keys that left by a name that
outlives the slot (``ghost_name``), as a slot is reused for another key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Annotated, Any

from pydantic import Field

from lmkv.contracts.plugin import OptionsArg, PluginOptions
from lmkv.contracts.policy import EvictionContext, EvictionPolicy
from lmkv_policies.ghosts import ghost_name, same_name


class LFUOptions(PluginOptions):
    decay_period: Annotated[int, Field(strict=True, ge=0)] = 0
    """Uses (stores and reads) between two agings; 0: ten times the entries stored."""
    decay_factor: Annotated[float, Field(ge=0.01, le=1)] = 0.5
    """What ageing multiplies every count by (rounded down, at least 1); 1: no ageing."""
    max_frequency: Annotated[int, Field(strict=True, ge=1, le=1 << 16)] = 255
    """The highest count a key reaches (more uses do not raise it)."""
    history: Annotated[float, Field(ge=0, le=16)] = 2.0
    """Counts of evicted keys remembered, as a share of the most entries stored
    (a key stored again resumes its count); 0: a stored key starts at 1."""


class LFUPolicy(EvictionPolicy):
    name = "lfu"
    api_version = "2.1"
    orders_slots = True
    Options = LFUOptions
    options: LFUOptions

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        #: Every stored key's count.
        self._count: dict[Hashable, int] = {}
        #: Leaves by count, least recent first within one count.
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self._uses = 0  # since the last ageing
        #: Counts of keys that left, least recent first (bounded: ``history``).
        self._history: OrderedDict[Hashable, int] = OrderedDict()
        self.c = 0  # the most entries stored at once
        #: What a key that left is remembered by (its slot's key, by slot).
        self._name: Callable[[Any], Hashable] = same_name

    def use_slots(self) -> None:
        self._name = ghost_name(self)

    # -- buckets ---------------------------------------------------------------
    def _enter(self, key: Hashable, count: int) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
        bucket[key] = None

    def _leave(self, key: Hashable, count: int) -> bool:
        bucket = self._buckets.get(count)
        if bucket is None or key not in bucket:
            return False
        del bucket[key]
        if not bucket:
            del self._buckets[count]
        return True

    # -- hooks -----------------------------------------------------------------
    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        history = self._history
        count = (min(history.pop(self._name(key), 0) + 1, self.options.max_frequency)
                 if history else 1)
        self._count[key] = count
        if self.lineage.is_leaf(key):
            self._enter(key, count)
        stored = len(self._count)
        if stored > self.c:
            self.c = stored
        self._used()

    def on_access(self, key: Hashable) -> None:
        count = self._count.get(key)
        if count is None:
            return
        new = min(count + 1, self.options.max_frequency)
        self._count[key] = new
        if self._leave(key, count):
            self._enter(key, new)
        self._used()

    def on_remove(self, key: Hashable) -> None:
        count = self._count.pop(key, None)
        if count is not None:
            self._leave(key, count)
            bound = int(self.options.history * self.c)
            if bound:
                history = self._history
                history[self._name(key)] = count
                while len(history) > bound:
                    history.popitem(last=False)

    def on_extended(self, key: Hashable) -> None:
        count = self._count.get(key)
        if count is not None:
            self._leave(key, count)

    def on_leaf(self, key: Hashable) -> None:
        count = self._count.get(key)
        if count is not None:
            self._enter(key, count)

    def victims(self) -> Iterator[Hashable]:
        buckets = self._buckets
        if len(buckets) == 1:
            return iter(next(iter(buckets.values())))
        return (key for count in sorted(buckets) for key in buckets[count])

    # -- ageing ------------------------------------------------------------------
    def _used(self) -> None:
        self._uses += 1
        period = self.options.decay_period or 10 * len(self._count)
        if self._uses >= period and self.options.decay_factor < 1:
            self._age()

    def _age(self) -> None:
        """Scale every count down, keeping each bucket's recency order."""
        self._uses = 0
        factor, counts = self.options.decay_factor, self._count
        for key, count in counts.items():
            counts[key] = max(1, int(count * factor))
        history = self._history
        for key, count in history.items():
            history[key] = int(count * factor)
        old, self._buckets = self._buckets, {}
        for count in sorted(old):
            for key in old[count]:
                self._enter(key, counts[key])

    def __len__(self) -> int:
        return len(self._count)
