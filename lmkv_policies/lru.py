"""``lru``: evict the least recently stored or read entry first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from lmkv.plugin_base import OptionsArg
from lmkv.policy import EvictionContext, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
