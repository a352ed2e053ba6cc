"""Scheduler side: asynchronous lookups over the lookup channel; load and store plans.

A lookup is started the first time vLLM asks about a request; until every
worker has answered (or the lookup timed out, which answers 0) vLLM is told
"not known yet" and asks again on a later step, so a slow tier never stalls
the scheduling loop. Asks may wait for answers, but all the asks of one
scheduling step together wait at most ``lookup.backoff_ms``: a lone request
gets its (typically sub-millisecond) answer in the step that asked, a burst
of new requests has all its lookups in flight at once and is answered on the
next step, and a slow lookup costs a step at most that much.


Loads are synchronous by default (the worker copies the KV in before the
step's forward). With ``async_load`` vLLM is told the load is asynchronous:
the load is planned as soon as vLLM has allocated the blocks, the worker runs
it in the background while other requests' steps go on, and vLLM schedules
the request once every worker reported it finished.

Eager offload: every step's newly computed whole chunks of the prompt are
planned as a store for the workers (``wait_for_save``). Lazy offload: those
plans are buffered in ``LazyOffload`` and submitted after requests finish.

Every request's identity (LoRA adapter, cache salt, multimodal inputs, prompt
embeddings: ``identity.request_identity``) is read once, when vLLM first asks
about it, and goes with its lookup and with every load and store plan. A
request whose identity was never read is neither loaded nor stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmkv.config import LMKVConfig
from lmkv.integrations.vllm.identity import request_identity
from lmkv.integrations.vllm.lazy import LazyOffload
from lmkv.integrations.vllm.specs import BlockNames, LoadSpec, StepPlan, StoreSpec
from lmkv.lookup.client import LookupClient
from lmkv.tokens import Identity

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    prompt: list[int]
    block_ids: list[int]
    stored: int = 0  # tokens planned for storing so far (whole chunks)


@dataclass
class SchedulerCounters:
    lookups: int = 0
    load_tokens: int = 0  # tokens planned for loading
    store_tokens: int = 0  # tokens planned for storing


class SchedulerSide:
    def __init__(self, config: LMKVConfig, vllm_config: Any,
                 lazy: LazyOffload | None = None) -> None:
        self.chunk_size = config.chunk_size
        self.lazy = lazy
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        world_size = vllm_config.parallel_config.world_size
        vllm_block = vllm_config.cache_config.block_size
        self.client = LookupClient.from_config(
            config, engine_id=engine_id, world_size=world_size, block_size=vllm_block,
            max_tokens=vllm_config.model_config.max_model_len)
        # Hits, loads and stores in whole blocks of lmkv (vLLM's block by default;
        # whole chunks when block hits are off), rounded to vLLM's blocks.
        self.unit = self.client.block_size or self.chunk_size
        self._vllm_block = vllm_block or 1
        self.counters = SchedulerCounters()
        self._step_wait_s = config.lookup.backoff_ms / 1000
        self._wait_left_s = self._step_wait_s  # of this scheduling step
        self._hits: dict[str, int] = {}  # req id -> stored prefix (tokens)
        self._held: set[str] = set()  # req ids whose prefetch no load has claimed yet
        self._pending: dict[str, int] = {}  # req id -> tokens looked up, answer not in yet
        self._loads: dict[str, int] = {}  # req id -> external tokens vLLM allocated for
        self._reqs: dict[str, _Req] = {}
        self._requests: dict[str, Any] = {}  # req id -> vLLM Request (its block hashes)
        self.async_load = config.async_load
        self._local: dict[str, int] = {}  # req id -> tokens vLLM had when it asked
        self._async_specs: list[LoadSpec] = []  # planned, for the next step's metadata
        self._async_loaded: dict[str, int] = {}  # req id -> tokens an async load brings
        self._identities: dict[str, Identity | None] = {}  # req id -> what names its chunks
        #: vLLM's names of a request's first N tokens' blocks (set by the connector
        #: when vLLM publishes KV events; ``events.block_names``).
        self.name_blocks: Callable[[Any, int], BlockNames | None] | None = None

    # -- lookup ----------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed: int) -> int | None:
        """Tokens lmkv can load beyond ``num_computed``; None while the workers
        have not all answered (vLLM asks again later)."""
        req_id = request.request_id
        self._requests[req_id] = request
        self._local[req_id] = num_computed
        if req_id not in self._identities:
            self._identities[req_id] = request_identity(request, self.chunk_size)
        hit = self._hits.get(req_id)
        if hit is None:
            limit = self._pending.get(req_id)
            if limit is None:
                prompt = request.prompt_token_ids or []
                # Never the whole prompt: vLLM must compute the last token itself.
                limit = self._round(len(prompt) - 1)
                if limit <= num_computed:
                    self._hits[req_id] = 0
                    return 0
                self.counters.lookups += 1
                self._pending[req_id] = limit
                self.client.lookup(req_id, prompt[:limit], self._identities[req_id])
            t0 = time.monotonic()
            result = self.client.poll(req_id, self._wait_left_s)
            self._wait_left_s -= time.monotonic() - t0
            if result is None:
                return None
            del self._pending[req_id]
            hit = self._round(max(0, min(result, limit)))
            self._hits[req_id] = hit
            if result > 0:
                self._held.add(req_id)
        return max(0, hit - num_computed)

    def _round(self, tokens: int) -> int:
        """``tokens`` down to whole lmkv blocks that are whole vLLM blocks too."""
        tokens = max(0, tokens) // self.unit * self.unit
        return tokens // self._vllm_block * self._vllm_block

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        """``block_ids``: the request's whole block table (vLLM's blocks for it)."""
        req_id = request.request_id
        self._requests[req_id] = request
        if num_external <= 0:
            self._drop_prefetch(req_id)  # nothing will be loaded
            return
        self._held.discard(req_id)  # the worker's load takes the prefetch
        if self.async_load:
            local = self._local.get(req_id, 0)
            end = local + num_external
            prompt = list(request.prompt_token_ids or [])
            self._async_specs.append(LoadSpec(req_id, prompt[:end], list(block_ids), local,
                                              async_load=True,
                                              identity=self._identities.get(req_id)))
            self._async_loaded[req_id] = end
            self._count_load(req_id, num_external, local, "asynchronously ")
        else:
            self._loads[req_id] = num_external

    def _drop_prefetch(self, req_id: str) -> None:
        """Have the workers release a prefetch that no load will take."""
        if req_id in self._held:
            self._held.discard(req_id)
            self.client.cancel(req_id)

    # -- per step --------------------------------------------------------------
    def build_meta(self, out: Any) -> StepPlan:
        self._wait_left_s = self._step_wait_s  # the end of a step: a fresh wait budget
        meta = StepPlan()
        meta.loads.extend(self._async_specs)
        self._async_specs = []
        for new in out.scheduled_new_reqs:
            req = self._reqs[new.req_id] = _Req(list(new.prompt_token_ids or []),
                                                list(new.block_ids[0]))
            req.stored = self._async_loaded.pop(new.req_id, 0)  # loaded: stored already
            self._plan_load(new.req_id, req, new.num_computed_tokens, meta)
            self._plan_store(new.req_id, req, new.num_computed_tokens
                             + out.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: a fresh block table
                req.block_ids = list(new_ids[0]) if new_ids else []
                req.stored = 0
            elif new_ids:
                req.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            self._plan_load(req_id, req, computed, meta)
            self._plan_store(req_id, req, computed + out.num_scheduled_tokens.get(req_id, 0),
                             meta)
        if self.lazy is not None:
            meta.stores.extend(self.lazy.select(out.total_num_scheduled_tokens))
        return meta

    def _plan_load(self, req_id: str, req: _Req, computed: int,
                   meta: StepPlan) -> None:
        num_external = self._loads.pop(req_id, 0)
        if not num_external:
            return
        meta.loads.append(LoadSpec(req_id, req.prompt[:computed], list(req.block_ids),
                                   computed - num_external,
                                   identity=self._identities.get(req_id)))
        req.stored = max(req.stored, computed)
        self._count_load(req_id, num_external, computed - num_external)

    def _count_load(self, req_id: str, tokens: int, local: int, how: str = "") -> None:
        self.counters.load_tokens += tokens
        logger.info("lmkv: request %s loads %d tokens from lmkv %s(%d already in vLLM)",
                    req_id, tokens, how, local)

    def _plan_store(self, req_id: str, req: _Req, computed: int,
                    meta: StepPlan) -> None:
        end = self._round(min(computed, len(req.prompt)))
        if end > req.stored and req_id in self._identities:
            spec = StoreSpec(req_id, req.prompt[:end], list(req.block_ids),
                             identity=self._identities[req_id])
            request = self._requests.get(req_id)
            if self.name_blocks is not None and request is not None:
                spec.blocks = self.name_blocks(request, end)  # for KV events (events.py)
            if self.lazy is None:
                meta.stores.append(spec)
            else:
                self.lazy.add(spec, request.block_hashes if request is not None else [])
            self.counters.store_tokens += end - req.stored
            req.stored = end

    def finished(self, request: Any) -> None:
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._local.pop(req_id, None)
        self._async_loaded.pop(req_id, None)
        self._identities.pop(req_id, None)
        if self._pending.pop(req_id, None) is not None:
            self.client.cancel(req_id)  # finished (aborted) before the answer came
        if self.lazy is not None:
            self.lazy.finished(req_id)
        self._hits.pop(req_id, None)
        self._drop_prefetch(req_id)

    def confirmed(self, done: dict[str, int]) -> None:
        if self.lazy is not None:
            self.lazy.confirmed(done)

    def close(self) -> None:
        logger.info("lmkv scheduler counters: %s, lookup channel: %s",
                    vars(self.counters), self.client.stats())
        self.client.close()
