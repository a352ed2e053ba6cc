"""Lazy offload on the scheduler (described in docs/vllm.md): buffer each
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
as a ``before_compute`` store: the workers copy it when vLLM binds the step's
metadata, before any connector's loads and the forward (``WorkerSide.rescue``).
Blocks the step zeroes or copies into before then are never rescued, nor blocks
not watched since the finish, nor anything after a prefix-cache reset (which
fires the same watchers). Nothing waits: vLLM frees as before, and a block is
read only at the moment it would be lost.

Pure Python: vLLM's block pool comes in through ``pool`` (``.blocks[id]`` with
``.block_hash``, ``touch(blocks)``, ``free_blocks(blocks)``, and, for rescues,
``unpin_blocks(blocks, on_reuse)``) and ``block_hash_of`` (the pool's hash of
a block -> the request's block hash).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lmkv.config.model import LMKVConfig
from lmkv.contracts.policy import OffloadContext
from lmkv.integrations.vllm.specs import StoreSpec
from lmkv.metrics import recorder

logger = logging.getLogger(__name__)

#: How long an idle engine keeps stepping for confirmations that do not come.
RELEASE_STEPPING_S = 30.0


@dataclass
class _Plan:
    """A request's store: its longest plan on its current block table, the hash of
    each block it reads by position (``snapshot[i]`` for ``spec.block_ids[i]``),
    and, once finished, the blocks watched for reuse."""

    spec: StoreSpec
    snapshot: list[Any]
    watched: set[int] = field(default_factory=set)


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
        self._pending: set[str] = set()  # requests with buffered stores, not finished
        self._plans: dict[str, _Plan] = {}  # buffered, not submitted (finished or not)
        self._protected: dict[str, list[Any]] = {}  # store id -> touched blocks
        self._clock: Callable[[], float] = time.monotonic
        self._moved = 0.0  # when a store was last protected or released
        self._warned = False  # the stall warning, once per stall
        self._confirmed: dict[str, int] = {}  # store id -> workers that confirmed
        self._ids = itertools.count()
        self.skipped = 0
        # Rescue (module docstring).
        self._watchers: dict[int, set[str]] = {}  # block id -> finished requests
        self._reused: dict[int, Any] = {}  # handed out since the last step: its hash then
        self._rescued: set[str] = set()  # stored already; the policy's item is dropped
        self.rescued = 0
        logger.info("lazy offload enabled with %s policy, offload threshold: %d",
                    config.lazy_offload_policy.type, config.lazy_offload_threshold)

    # 1. buffer
    def add(self, spec: StoreSpec, request_block_hashes: Sequence[Any]) -> None:
        """Buffer ``spec`` with the request's hash of every block it reads."""
        n = min(-(-len(spec.token_ids) // self.block_size), len(spec.block_ids))
        snapshot = [request_block_hashes[i] if i < len(request_block_hashes) else None
                    for i in range(n)]
        self.policy.add(spec, dict(zip(spec.block_ids, snapshot, strict=False)))
        kept = self._plans.get(spec.req_id)
        if kept is not None and spec.req_id not in self._pending:
            self._unwatch(spec.req_id, kept)  # an id used again: the old plan is done
            kept = None
        self._pending.add(spec.req_id)
        self._rescued.discard(spec.req_id)  # (its policy item now carries the new request)
        # The longest plan (the latest among equals) covers the request's earlier
        # steps; a plan on another block table (a preempted request resumed) replaces
        # it: each plan is verified against its own blocks' hashes only.
        if (kept is None or len(spec.token_ids) >= len(kept.spec.token_ids)
                or not _same_table(kept.spec.block_ids, spec.block_ids)):
            self._plans[spec.req_id] = _Plan(spec, snapshot)

    # 2. finish
    def finished(self, req_id: str, block_ids: Sequence[int] | None = None) -> None:
        """vLLM finished ``req_id`` and frees its blocks (``block_ids``) after this
        returns. The plan is cut where its blocks stop being the request's."""
        if req_id not in self._pending:
            return
        self._pending.discard(req_id)
        try:
            self.policy.mark_req_finished(req_id)
        except ValueError as exc:  # (an id used again whose item the policy gave out)
            logger.warning("lmkv: lazy offload: %s; request %s is not stored", exc, req_id)
            self._plans.pop(req_id, None)
            return
        plan = self._plans.get(req_id)
        if plan is None:
            return
        if block_ids is not None:
            keep = 0
            while (keep < len(plan.snapshot) and keep < len(block_ids)
                   and plan.spec.block_ids[keep] == block_ids[keep]):
                keep += 1
            if keep < len(plan.snapshot):
                plan.spec = replace(plan.spec, block_ids=plan.spec.block_ids[:keep],
                                    token_ids=plan.spec.token_ids[:keep * self.block_size])
                plan.snapshot = plan.snapshot[:keep]
        self._watch(req_id, plan)

    def _watch(self, req_id: str, plan: _Plan) -> None:
        """Ask the pool to call ``_on_reuse`` when it hands out one of the leading
        blocks the request still holds intact. ``touch`` then ``unpin_blocks``
        leaves every reference count as it was (the request still holds its blocks
        here): only the watcher stays."""
        unpin = getattr(self.pool, "unpin_blocks", None)
        if unpin is None:  # a vLLM without reuse watchers: no rescue
            return
        blocks = []
        for i, expected in enumerate(plan.snapshot):
            block = self.pool.blocks[plan.spec.block_ids[i]]
            if (block.ref_cnt <= 0 or getattr(block, "is_null", False)
                    or not self._intact(block.block_id, expected)):
                break  # a rescue stops at the first block not watched
            blocks.append(block)
        if not blocks:
            return
        plan.watched = {b.block_id for b in blocks}
        for block in blocks:
            self._watchers.setdefault(block.block_id, set()).add(req_id)
        self.pool.touch(blocks)
        unpin(blocks, self._on_reuse)

    def _on_reuse(self, block: Any) -> None:
        """Called by the pool before it hands ``block`` out (``get_new_blocks``, the
        block's hash still cached then), and before any worker writes it; or when it
        resets the prefix cache (sleep, weight updates): the KV may be gone or
        stale then, so the watching requests are never rescued."""
        waiting = self._watchers.get(block.block_id)
        if not waiting:
            return
        if self._handed_out(block):
            self._reused[block.block_id] = block.block_hash
            return
        for req_id in list(waiting):
            plan = self._plans.get(req_id)
            if plan is not None:
                self._unwatch(req_id, plan)

    def _handed_out(self, block: Any) -> bool:
        cached = getattr(self.pool, "cached_block_hash_to_block", None)
        contain = getattr(cached, "contain", None)
        return (contain is not None and block.block_hash is not None
                and bool(contain(block.block_hash, block.block_id)))

    def _unwatch(self, req_id: str, plan: _Plan) -> None:
        for bid in plan.watched:
            waiting = self._watchers.get(bid)
            if waiting is not None:
                waiting.discard(req_id)
                if not waiting:
                    del self._watchers[bid]
        plan.watched = set()

    # 3. select and 4. verify
    def select(self, num_scheduled_tokens: int,
               overwritten: Callable[[], Collection[int]] = tuple) -> list[StoreSpec]:
        """The stores to submit this step: rescues on every step (``build_meta``
        calls this once per scheduling step), the policy's choice only on a step
        with scheduled tokens. ``overwritten()``: blocks the workers write this step
        before they bind its metadata (vLLM's zeroing and copy-on-write targets),
        asked only when a rescue is due."""
        out = self._rescue(overwritten)
        if num_scheduled_tokens <= 0:
            return out
        for item in self.policy.pop_items_for_offload(self.select_count):
            if item.req_id in self._rescued:
                self._rescued.discard(item.req_id)
                continue
            plan = self._plans.pop(item.req_id, None)
            if plan is None or not plan.snapshot:
                continue
            self._unwatch(item.req_id, plan)
            spec = plan.spec
            block_ids = spec.block_ids[:len(plan.snapshot)]
            if not all(self._intact(bid, h) for bid, h in zip(block_ids, plan.snapshot,
                                                              strict=True)):
                self._skip()
                logger.warning("block hashes mismatch for request %s, skip it", spec.req_id)
                continue
            store_id = f"{spec.req_id}#{next(self._ids)}"
            blocks = [self.pool.blocks[bid] for bid in block_ids]
            self.pool.touch(blocks)
            self._protected[store_id] = blocks
            self._moved, self._warned = self._clock(), False
            out.append(replace(spec, block_ids=block_ids, store_id=store_id))
        return out

    def _rescue(self, overwritten_of: Callable[[], Collection[int]]) -> list[StoreSpec]:
        """``before_compute`` stores of the finished requests whose blocks the pool
        handed out since the last step, each cut before its first block that may no
        longer hold the request's KV: one not watched, one written before the
        workers bind the step's metadata, or one whose hash differs."""
        reused, self._reused = self._reused, {}
        hit = {req for bid in reused for req in self._watchers.get(bid, ())}
        if not hit:
            return []
        overwritten = overwritten_of()
        out = []
        for req_id in [r for r in self._plans if r in hit]:  # in arrival order
            plan = self._plans.pop(req_id)
            watched = plan.watched
            self._unwatch(req_id, plan)
            self._rescued.add(req_id)
            good = 0
            for bid, expected in zip(plan.spec.block_ids, plan.snapshot, strict=False):
                if bid not in watched or bid in overwritten or expected is None:
                    break
                if bid in reused:  # its hash when handed out, before vLLM dropped it
                    held = reused[bid]
                    if held is None or self.block_hash_of(held) != expected:
                        break
                elif not self._intact(bid, expected):
                    break
                good += 1
            end = min(len(plan.spec.token_ids), good * self.block_size)
            if end <= 0:
                self._skip()
                continue
            self.rescued += 1
            recorder().add("lazy_offload_rescues_total")
            out.append(replace(plan.spec, token_ids=plan.spec.token_ids[:end],
                               block_ids=plan.spec.block_ids[:good], store_id=None,
                               before_compute=True))
        return out

    def _skip(self) -> None:
        self.skipped += 1
        recorder().add("lazy_offload_skipped_total")

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
                self._moved, self._warned = self._clock(), False

    def awaits_release(self) -> bool:
        """Whether protected blocks wait for the workers' confirmations, at most
        ``RELEASE_STEPPING_S`` after a store was last protected or released (then
        False, with one warning: a store never confirmed cannot keep an idle engine
        stepping; its blocks go back when traffic brings steps)."""
        if not self._protected:
            return False
        stalled = self._clock() - self._moved
        if stalled < RELEASE_STEPPING_S:
            return True
        if not self._warned:
            self._warned = True
            logger.warning("lmkv: %d lazy store(s) unconfirmed for %.0f s; their blocks "
                           "are held until a request brings an engine step",
                           len(self._protected), stalled)
        return False

    @property
    def queue_depth(self) -> int:
        """Requests with stores buffered, plus stores submitted and not yet confirmed."""
        return len(self._pending) + len(self._protected)

    @property
    def protected_stores(self) -> int:
        return len(self._protected)


def _same_table(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two plans of one request read the same blocks where both reach."""
    common = min(len(a), len(b))
    return list(a[:common]) == list(b[:common])
