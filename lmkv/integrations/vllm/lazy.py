"""Lazy offload on the scheduler (ARCHITECTURE.md "Lazy offload"): buffer each
step's stores with a block-hash snapshot, submit finished requests' stores in
batches chosen by the offload policy, verify the snapshot, protect the blocks
until every worker confirms the store, then release them.

Rescue: a finished request's blocks are freed at once, and under KV pressure
vLLM hands them to the next request before the policy submits their store; the
verify then finds their hashes changed and the KV is lost. So at finish lmkv
asks the pool to tell it when each block is handed out again
(``unpin_blocks(..., on_reuse)``, vLLM's watcher for blocks "readable until
reused"). A block handed out in a scheduling step still holds the old KV until
that step's worker runs, so the request's store is submitted in that very step
as a ``before_compute`` store: the workers copy it before the step's loads and
forward write anything (``worker.load``), and the scheduler makes vLLM call
``start_load_kv`` before the forward (``has_sync_kv_loads``). Blocks the step
zeroes or copies into before then are never rescued. Nothing waits: vLLM frees
as before, and a block is read only at the moment it would be lost.

Pure Python: vLLM's block pool comes in through ``pool`` (``.blocks[id]`` with
``.block_hash``, ``touch(blocks)``, ``free_blocks(blocks)``, and, for rescues,
``unpin_blocks(blocks, on_reuse)``) and ``block_hash_of`` (the pool's hash of
a block -> the request's block hash).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Sequence
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
        # Rescue (module docstring): each pending request's longest plan and its
        # blocks' hashes; once finished, the blocks watched for reuse.
        self._plans: dict[str, tuple[StoreSpec, dict[int, Any]]] = {}
        self._waiting: dict[str, tuple[StoreSpec, dict[int, Any]]] = {}  # finished
        self._watchers: dict[int, set[str]] = {}  # block id -> waiting requests
        self._reused: dict[int, Any] = {}  # handed out since the last step: its hash then
        self._rescued: set[str] = set()  # stored already; the policy's item is dropped
        self.rescued = 0
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
        kept = self._plans.get(spec.req_id)
        if kept is None:
            self._plans[spec.req_id] = (spec, snapshot)
        else:  # the longest plan (the latest among equals), every block's hash
            longest = spec if len(spec.token_ids) >= len(kept[0].token_ids) else kept[0]
            self._plans[spec.req_id] = (longest, {**kept[1], **snapshot})

    # 2. finish
    def finished(self, req_id: str) -> None:
        """vLLM finished ``req_id`` and frees its blocks after this returns."""
        if req_id in self._pending:
            self._pending.discard(req_id)
            self.policy.mark_req_finished(req_id)
            plan = self._plans.pop(req_id, None)
            if plan is not None:
                self._watch(req_id, *plan)

    def _watch(self, req_id: str, spec: StoreSpec, snapshot: dict[int, Any]) -> None:
        """Ask the pool to call ``_on_reuse`` when it hands out one of the request's
        intact blocks. ``touch`` then ``unpin_blocks`` leaves every reference count
        as it was (the request still holds its blocks here): only the watcher stays."""
        unpin = getattr(self.pool, "unpin_blocks", None)
        if unpin is None:  # a vLLM without reuse watchers: no rescue
            return
        n = -(-len(spec.token_ids) // self.block_size)
        blocks = [self.pool.blocks[bid] for bid in spec.block_ids[:n]
                  if self._intact(bid, snapshot.get(bid))]
        blocks = [b for b in blocks if b.ref_cnt > 0 and not getattr(b, "is_null", False)]
        if not blocks:
            return
        self._waiting[req_id] = (spec, snapshot)
        for block in blocks:
            self._watchers.setdefault(block.block_id, set()).add(req_id)
        self.pool.touch(blocks)
        unpin(blocks, self._on_reuse)

    def _on_reuse(self, block: Any) -> None:
        """The pool hands ``block`` out (or resets the prefix cache): called before
        it drops the block's hash, and before any worker writes the block."""
        if block.block_id in self._watchers:
            self._reused[block.block_id] = block.block_hash

    def _unwatch(self, req_id: str) -> tuple[StoreSpec, dict[int, Any]] | None:
        plan = self._waiting.pop(req_id, None)
        if plan is not None:
            for bid in plan[0].block_ids:
                waiting = self._watchers.get(bid)
                if waiting is not None:
                    waiting.discard(req_id)
                    if not waiting:
                        del self._watchers[bid]
        return plan

    # 3. select and 4. verify
    def select(self, num_scheduled_tokens: int,
               overwritten: Collection[int] = ()) -> list[StoreSpec]:
        """The stores to submit this step: rescues on every step (``build_meta``
        calls this once per scheduling step), the policy's choice only on a step
        with scheduled tokens. ``overwritten``: blocks the workers write this step
        before ``start_load_kv`` (vLLM's zeroing and copy-on-write targets)."""
        out = self._rescue(overwritten)
        if num_scheduled_tokens <= 0:
            return out
        for item in self.policy.pop_items_for_offload(self.select_count):
            if item.req_id in self._rescued:
                self._rescued.discard(item.req_id)
                continue
            self._unwatch(item.req_id)
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

    def _rescue(self, overwritten: Collection[int]) -> list[StoreSpec]:
        """``before_compute`` stores of the waiting requests whose blocks the pool
        handed out since the last step, each cut before its first block that no
        longer holds the request's KV."""
        reused, self._reused = self._reused, {}
        if not reused:
            return []
        hit = {req for bid in reused for req in self._watchers.get(bid, ())}
        out = []
        for req_id in [r for r in self._waiting if r in hit]:  # in finishing order
            spec, snapshot = self._unwatch(req_id)  # type: ignore[misc]
            self._rescued.add(req_id)
            n = -(-len(spec.token_ids) // self.block_size)
            good = 0
            for bid in spec.block_ids[:n]:
                expected = snapshot.get(bid)
                if bid in overwritten:
                    break
                if bid in reused:  # its hash when handed out, before vLLM dropped it
                    held = reused[bid]
                    if expected is None or held is None or self.block_hash_of(held) != expected:
                        break
                elif not self._intact(bid, expected):
                    break
                good += 1
            end = min(len(spec.token_ids), good * self.block_size)
            if end <= 0:
                self.skipped += 1
                continue
            self.rescued += 1
            out.append(replace(spec, token_ids=spec.token_ids[:end],
                               block_ids=spec.block_ids[:good], store_id=None,
                               before_compute=True))
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
