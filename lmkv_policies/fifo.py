"""``FIFO`` lazy-offload policy: finished requests leave in the order they arrived.

The lazy offload of docs/vllm.md: nothing is popped until
``threshold`` requests are finished; then at most ``count`` finished items
are popped in insertion order (unfinished ones are skipped and stay), and the
popped ones leave the ready count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmkv.contracts.plugin import OptionsArg
from lmkv.contracts.policy import OffloadContext, OffloadItem, OffloadPolicy, StoreMeta


class FIFOOffloadPolicy(OffloadPolicy):
    name = "FIFO"
    api_version = "2.0"

    def __init__(self, options: OptionsArg, context: OffloadContext) -> None:
        super().__init__(options, context)
        self._items: dict[str, OffloadItem] = {}  # insertion ordered
        self._ready = 0

    def add(self, meta: StoreMeta, block_hashes: Mapping[int, Any]) -> None:
        item = self._items.get(meta.req_id)
        if item is None:
            item = self._items[meta.req_id] = OffloadItem(meta.req_id)
        item.metas.append(meta)
        item.block_hashes.update(block_hashes)

    def mark_req_finished(self, req_id: str) -> None:
        item = self._items.get(req_id)
        if item is None:
            raise ValueError(f"request {req_id!r} has no pending store")
        if not item.finished:
            item.finished = True
            self._ready += 1

    def pop_items_for_offload(self, count: int) -> list[OffloadItem]:
        if count <= 0 or self._ready < self.threshold:
            return []
        return self._pop_finished(count)

    def _pop_finished(self, count: int) -> list[OffloadItem]:
        """Pop at most ``count`` finished items, oldest first; unfinished ones stay."""
        popped: list[OffloadItem] = []
        for req_id, item in list(self._items.items()):
            if len(popped) >= count:
                break
            if item.finished:
                popped.append(self._items.pop(req_id))
        self._ready -= len(popped)
        return popped

    @property
    def ready_count(self) -> int:
        return self._ready

    def __len__(self) -> int:
        return len(self._items)
