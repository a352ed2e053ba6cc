"""Lazy offload on the scheduler (ARCHITECTURE.md "Lazy offload"): buffer each
step's stores with a block-hash snapshot, submit finished requests' stores in
batches chosen by the offload policy, verify the snapshot, protect the blocks
until every worker confirms the store, then release them.

Pure Python: vLLM's block pool comes in through ``pool`` (``.blocks[id]`` with
``.block_hash``, ``touch(blocks)``, ``free_blocks(blocks)``) and
``block_hash_of`` (the pool's hash of a block -> the request's block hash).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lmkv.config import LMKVConfig
from lmkv.integrations.vllm.specs import StoreSpec
from lmkv.policy import OffloadContext

logger = logging.getLogger(__name__)


class LazyOffload:
    def __init__(self, config: LMKVConfig, *, block_size: int, world_size: int,
                 pool: Any = None, block_hash_of: Callable[[Any], Any] = lambda h: h) -> None:
        self.policy = config.plugins.offload_policy.create(
            OffloadContext(threshold=config.lazy_offload_threshold))
        self.select_count = config.lazy_offload_select_count
        self.block_size = block_size
        self.world_size = world_size
        self.pool = pool
        self.block_hash_of = block_hash_of
        self._pending: set[str] = set()  # requests with buffered stores
        self._protected: dict[str, list[Any]] = {}  # store id -> touched blocks
        self._confirmed: dict[str, int] = {}  # store id -> workers that confirmed
        self._ids = itertools.count()
        self.skipped = 0
        logger.info("lazy offload enabled with %s policy, offload threshold: %d",
                    config.lazy_offload_policy.type, config.lazy_offload_threshold)

    # 1. buffer
    def add(self, spec: StoreSpec, request_block_hashes: Sequence[Any]) -> None:
        """Buffer ``spec`` with the request's hash of every block it reads."""
        n = -(-len(spec.token_ids) // self.block_size)
        snapshot = {bid: (request_block_hashes[i] if i < len(request_block_hashes) else None)
                    for i, bid in enumerate(spec.block_ids[:n])}
        self.policy.add(spec, snapshot)
        self._pending.add(spec.req_id)

    # 2. finish
    def finished(self, req_id: str) -> None:
        if req_id in self._pending:
            self._pending.discard(req_id)
            self.policy.mark_req_finished(req_id)

    # 3. select and 4. verify
    def select(self, num_scheduled_tokens: int) -> list[StoreSpec]:
        """The stores to submit this step (only on a step with scheduled tokens)."""
        if num_scheduled_tokens <= 0:
            return []
        out = []
        for item in self.policy.pop_items_for_offload(self.select_count):
            if not item.metas:
                continue
            # The steps of a request aggregate into one store: its longest plan
            # (the latest among equals, e.g. after a preemption) covers the others.
            spec = max(reversed(item.metas), key=lambda m: len(m.token_ids))
            n = -(-len(spec.token_ids) // self.block_size)
            block_ids = spec.block_ids[:n]
            if not all(self._intact(bid, item.block_hashes.get(bid)) for bid in block_ids):
                self.skipped += 1
                logger.warning("block hashes mismatch for request %s, skip it", spec.req_id)
                continue
            store_id = f"{spec.req_id}#{next(self._ids)}"
            blocks = [self.pool.blocks[bid] for bid in block_ids]
            self.pool.touch(blocks)
            self._protected[store_id] = blocks
            out.append(replace(spec, block_ids=block_ids, store_id=store_id))
        return out

    def _intact(self, block_id: int, snapshot: Any) -> bool:
        current = self.pool.blocks[block_id].block_hash
        return (snapshot is not None and current is not None
                and self.block_hash_of(current) == snapshot)

    # 5. release
    def confirmed(self, counts: dict[str, int]) -> None:
        """Workers confirmed these stores (``store id -> workers``, summed over ranks)."""
        for store_id, n in counts.items():
            total = self._confirmed.get(store_id, 0) + n
            if total < self.world_size:
                self._confirmed[store_id] = total
                continue
            self._confirmed.pop(store_id, None)
            blocks = self._protected.pop(store_id, None)
            if blocks is not None:
                self.pool.free_blocks(blocks)

    @property
    def queue_depth(self) -> int:
        """Requests with stores buffered, plus stores submitted and not yet confirmed."""
        return len(self._pending) + len(self._protected)

    @property
    def protected_stores(self) -> int:
        return len(self._protected)
