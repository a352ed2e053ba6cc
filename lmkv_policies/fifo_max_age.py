"""``FIFO_MAX_AGE``: FIFO that also flushes finished requests that waited too long.

FIFO's known gap: when traffic slows down, fewer than ``threshold`` finished
requests may sit in the pending store indefinitely, their KV never offloaded.
This policy behaves exactly like FIFO, except that once the oldest finished
request has waited ``max_age_s`` since it finished, finished requests are
popped (oldest first, at most ``count``) even below the threshold.

The engine asks the policy only on steps that schedule tokens, so "waited
``max_age_s``" means "is flushed on the first such step after ``max_age_s``".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from lmkv.contracts.plugin import OptionsArg, PluginOptions
from lmkv.contracts.policy import OffloadContext, OffloadItem
from lmkv_policies.fifo import FIFOOffloadPolicy


class MaxAgeOptions(PluginOptions):
    max_age_s: Annotated[float, Field(gt=0)] = 2.0
    """Seconds a finished request may wait below the threshold before it is flushed."""


class FIFOMaxAgeOffloadPolicy(FIFOOffloadPolicy):
    name = "FIFO_MAX_AGE"
    api_version = "2.0"
    Options = MaxAgeOptions
    options: MaxAgeOptions

    def __init__(self, options: OptionsArg, context: OffloadContext) -> None:
        super().__init__(options, context)
        self._clock = context.clock
        self._finished_at: dict[str, float] = {}

    def mark_req_finished(self, req_id: str) -> None:
        super().mark_req_finished(req_id)
        self._finished_at.setdefault(req_id, self._clock())

    def pop_items_for_offload(self, count: int) -> list[OffloadItem]:
        if count <= 0:
            return []
        if self.ready_count >= self.threshold or self._oldest_waited_too_long():
            popped = self._pop_finished(count)
        else:
            popped = []
        for item in popped:
            self._finished_at.pop(item.req_id, None)
        return popped

    def _oldest_waited_too_long(self) -> bool:
        if not self._finished_at:
            return False
        oldest = next(iter(self._finished_at.values()))  # kept in finish order
        return self._clock() - oldest >= self.options.max_age_s
