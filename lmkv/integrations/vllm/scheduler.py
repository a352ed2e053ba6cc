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

Decode KV (``store_decode``): the same plans go on past the prompt, over the
request's known tokens (prompt + generated), as decode steps fill whole blocks
(see ``_plan_store``). Preemption: a request vLLM preempted and asks about
again is looked up afresh over all its known tokens (``_resume``).

Every request's identity (LoRA adapter, cache salt, multimodal inputs, prompt
embeddings: ``identity.request_identity``) is read once, when vLLM first asks
about it, and goes with its lookup and with every load and store plan. A
request whose identity was never read is neither loaded nor stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmkv.config.model import LMKVConfig
from lmkv.integrations.vllm.identity import request_identity
from lmkv.integrations.vllm.lazy import LazyOffload
from lmkv.integrations.vllm.specs import BlockNames, LoadSpec, StepPlan, StoreSpec
from lmkv.keys.chunking import Identity
from lmkv.lookup.client import LookupClient
from lmkv.metrics import recorder
from lmkv.metrics.record import record_lookup

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    prompt: list[int]
    block_ids: list[int]
    stored: int = 0  # tokens planned for storing so far (whole chunks)
    decode_counted: int = 0  # generated tokens counted as stored up to here


@dataclass
class SchedulerCounters:
    lookups: int = 0
    load_tokens: int = 0  # tokens planned for loading
    store_tokens: int = 0  # tokens planned for storing
    decode_stored_tokens: int = 0  # of those, generated tokens (lmkv.store_decode)
    preempted_resumes: int = 0  # resumes after a preemption that load from lmkv


class SchedulerSide:
    def __init__(self, config: LMKVConfig, vllm_config: Any,
                 lazy: LazyOffload | None = None) -> None:
        self.chunk_size = config.chunk_size
        self.lazy = lazy
        self.store_decode = config.store_decode
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
        self._asked: dict[str, float] = {}  # req id -> when its lookup was sent
        self._loads: dict[str, int] = {}  # req id -> external tokens vLLM allocated for
        self._reqs: dict[str, _Req] = {}
        self._requests: dict[str, Any] = {}  # req id -> vLLM Request (its block hashes)
        self.async_load = config.async_load
        self._local: dict[str, int] = {}  # req id -> tokens vLLM had when it asked
        self._async_specs: list[LoadSpec] = []  # planned, for the next step's metadata
        self._async_loaded: dict[str, int] = {}  # req id -> tokens an async load brings
        self._identities: dict[str, Identity | None] = {}  # req id -> what names its chunks
        # Preemption: the preemptions of each request already handled, and the
        # requests asked about again after one (their resume may load).
        self._preemptions: dict[str, int] = {}
        self._resuming: set[str] = set()
        self._finish_specs: list[StoreSpec] = []  # eager decode tails, for the next step
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
        preemptions = getattr(request, "num_preemptions", 0) or 0
        if preemptions > self._preemptions.get(req_id, 0):
            self._resume(req_id, preemptions)
        hit = self._hits.get(req_id)
        if hit is None:
            limit = self._pending.get(req_id)
            if limit is None:
                # All known tokens: the prompt, and after a preemption the tokens
                # generated so far too (the resumed prefill recomputes them).
                prompt = _known_tokens(request)
                # Never the whole prompt: vLLM must compute the last token itself.
                limit = self._round(len(prompt) - 1)
                if limit <= num_computed:
                    self._hits[req_id] = 0
                    return 0
                if self._finish_specs and self._extends_pending_tail(
                        prompt, self._identities[req_id]):
                    return None  # ask again next step, once the tail is stored
                self.counters.lookups += 1
                self._pending[req_id] = limit
                self._asked[req_id] = time.perf_counter()
                self.client.lookup(req_id, list(prompt[:limit]), self._identities[req_id])
            t0 = time.monotonic()
            result = self.client.poll(req_id, self._wait_left_s)
            self._wait_left_s -= time.monotonic() - t0
            if result is None:
                return None
            del self._pending[req_id]
            hit = self._round(max(0, min(result, limit)))
            self._hits[req_id] = hit
            record_lookup(limit, hit, self._asked.pop(req_id, time.perf_counter()))
            if result > 0:
                self._held.add(req_id)
        return max(0, hit - num_computed)

    def _resume(self, req_id: str, preemptions: int) -> None:
        """vLLM preempted ``req_id`` (freed its blocks, zeroed its computed tokens) and
        asks about it again: forget the lookup and load state of its previous run, so
        that it is looked up afresh over all its tokens (what lmkv holds now: its
        prompt's chunks, stored since, and with ``store_decode`` its decoded ones)."""
        self._preemptions[req_id] = preemptions
        self._asked.pop(req_id, None)
        if self._pending.pop(req_id, None) is not None:
            self.client.cancel(req_id)
        self._drop_prefetch(req_id)
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._async_loaded.pop(req_id, None)
        self._resuming.add(req_id)
        logger.info("lmkv: request %s resumes after preemption %d: looked up again",
                    req_id, preemptions)

    def _extends_pending_tail(self, tokens: Sequence[int], identity: Identity | None) -> bool:
        """Whether ``tokens`` extend the decode tail of a request that just finished,
        whose store goes out with this step (the next round of a conversation, asked
        in the same scheduling pass): looked up now, it would miss that tail."""
        for spec in self._finish_specs:
            n = len(spec.token_ids)
            if (len(tokens) > n and spec.identity == identity
                    and list(tokens[:n]) == spec.token_ids):
                return True
        return False

    def _round(self, tokens: int) -> int:
        """``tokens`` down to whole lmkv blocks that are whole vLLM blocks too."""
        tokens = max(0, tokens) // self.unit * self.unit
        return tokens // self._vllm_block * self._vllm_block

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        """``block_ids``: the request's whole block table (vLLM's blocks for it)."""
        req_id = request.request_id
        self._requests[req_id] = request
        resuming = req_id in self._resuming
        self._resuming.discard(req_id)
        if num_external <= 0:
            self._drop_prefetch(req_id)  # nothing will be loaded
            return
        if resuming:
            self.counters.preempted_resumes += 1
            recorder().add("preempted_resumes_total")
        self._held.discard(req_id)  # the worker's load takes the prefetch
        if self.async_load:
            local = self._local.get(req_id, 0)
            end = local + num_external
            prompt = _known_tokens(request)
            self._async_specs.append(LoadSpec(req_id, list(prompt[:end]), list(block_ids), local,
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
        meta.stores.extend(self._finish_specs)  # decode tails of finished requests
        self._finish_specs = []
        for new in out.scheduled_new_reqs:
            old = self._reqs.get(new.req_id)  # set: resumed (vLLM's V2 model runner)
            req = self._reqs[new.req_id] = _Req(list(new.prompt_token_ids or []),
                                                list(new.block_ids[0]))
            req.decode_counted = old.decode_counted if old is not None else 0
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
                req.stored = self._async_loaded.pop(req_id, 0)  # an async load: stored
            elif new_ids:
                req.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            self._plan_load(req_id, req, computed, meta)
            self._plan_store(req_id, req, computed + out.num_scheduled_tokens.get(req_id, 0),
                             meta)
        if self.lazy is not None:
            # Rescued blocks are handed out this step: the workers copy them when
            # vLLM binds this metadata, before any load or forward writes them.
            meta.stores.extend(self.lazy.select(out.total_num_scheduled_tokens,
                                                lambda: _overwritten(out)))
            recorder().set_gauge("lazy_offload_queue_depth", self.lazy.queue_depth)
        return meta

    def _plan_load(self, req_id: str, req: _Req, computed: int,
                   meta: StepPlan) -> None:
        num_external = self._loads.pop(req_id, 0)
        if not num_external:
            return
        tokens = self._tokens(req_id, req)  # a resumed request loads past its prompt
        meta.loads.append(LoadSpec(req_id, list(tokens[:computed]), list(req.block_ids),
                                   computed - num_external,
                                   identity=self._identities.get(req_id)))
        req.stored = max(req.stored, computed)
        self._count_load(req_id, num_external, computed - num_external)

    def _count_load(self, req_id: str, tokens: int, local: int, how: str = "") -> None:
        self.counters.load_tokens += tokens
        logger.info("lmkv: request %s loads %d tokens from lmkv %s(%d already in vLLM)",
                    req_id, tokens, how, local)

    def _tokens(self, req_id: str, req: _Req) -> Sequence[int]:
        """The request's known tokens (prompt + generated), its prompt when vLLM's
        ``Request`` is not at hand."""
        request = self._requests.get(req_id)
        return _known_tokens(request) if request is not None else req.prompt

    def _plan_store(self, req_id: str, req: _Req, computed: int,
                    meta: StepPlan) -> None:
        """``computed``: tokens whose KV is in vLLM's blocks once this step's forward
        ran (the workers store in ``wait_for_save``, after it).

        Decode KV (``store_decode``): the store goes past the prompt, over the known
        tokens. A decode step computes the KV of the token sampled by the step before
        (vLLM's ``Request`` holds its id by then); the newest sampled token has no KV
        yet and is never stored. Capping at the known tokens also leaves out
        speculative draft tokens (not in the request's tokens until accepted) and,
        under async scheduling, tokens whose ids are still in flight: those are
        stored one step later, or with the request's tail when it finishes
        (``_plan_decode_tail``). The plan is the prompt's (same
        rounding to whole lmkv/vLLM blocks, same identity, one chain of chunk keys):
        a later prompt that extends prompt + answer hits all of it."""
        limit = len(req.prompt)
        tokens: Sequence[int] = req.prompt
        if self.store_decode:
            tokens = self._tokens(req_id, req)
            limit = len(tokens)
        end = self._round(min(computed, limit))
        if self.store_decode and self.lazy is None and end > len(req.prompt):
            # Eager decode stores go in whole chunks: storing the growing partial
            # chunk at every new block would copy up to chunk/block times the KV (15x
            # with 256-token chunks and vLLM's GPU blocks of 16) and fill the tiers
            # with partial chunks. The block-aligned tail is stored once, when the
            # request finishes (``finished``). Lazy offload aggregates a request's
            # plans into its longest, so it keeps them per block.
            end = max(self._round(min(computed, len(req.prompt))),
                      end // self.chunk_size * self.chunk_size)
        if end > req.stored and req_id in self._identities:
            spec = StoreSpec(req_id, list(tokens[:end]), list(req.block_ids),
                             identity=self._identities[req_id])
            self._submit_store(req_id, req, spec, meta.stores)

    def _submit_store(self, req_id: str, req: _Req, spec: StoreSpec,
                      stores: list[StoreSpec]) -> None:
        """Send ``spec`` to the workers (eager: in ``stores``) or buffer it (lazy); count."""
        end = len(spec.token_ids)
        request = self._requests.get(req_id)
        if self.name_blocks is not None and request is not None:
            spec.blocks = self.name_blocks(request, end)  # for KV events (events.py)
        if self.lazy is None:
            stores.append(spec)
        else:
            self.lazy.add(spec, request.block_hashes if request is not None else [])
        self.counters.store_tokens += end - req.stored
        # Generated tokens: those past the prompt, each counted once (a resumed
        # request plans its stores again from its reload point).
        decode_from = max(req.stored, req.decode_counted, len(req.prompt))
        if end > decode_from:
            self.counters.decode_stored_tokens += end - decode_from
            recorder().add("decode_stored_tokens_total", end - decode_from)
            req.decode_counted = end
        req.stored = end

    def finished(self, request: Any, block_ids: Sequence[int] | None = None) -> bool:
        """vLLM is done with ``request``; ``block_ids``: its blocks of computed tokens.
        True: vLLM must keep those blocks until the workers report (``get_finished``)
        that they stored the request's decode tail (eager ``store_decode`` only)."""
        req_id = request.request_id
        delay = self._plan_decode_tail(request, list(block_ids or ()))
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._local.pop(req_id, None)
        self._async_loaded.pop(req_id, None)
        self._identities.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._preemptions.pop(req_id, None)
        self._resuming.discard(req_id)
        if self._pending.pop(req_id, None) is not None:
            self.client.cancel(req_id)  # finished (aborted) before the answer came
        if self.lazy is not None:
            self.lazy.finished(req_id, block_ids)
        self._hits.pop(req_id, None)
        self._drop_prefetch(req_id)
        return delay

    def _plan_decode_tail(self, request: Any, block_ids: list[int]) -> bool:
        """``store_decode``: plan the store of the whole blocks a finished request
        computed past its last stored plan (eager decode steps store whole chunks
        only; under async scheduling the last sampled ids came late). Eager: for the
        next step, whose ``wait_for_save`` runs after every forward that computed them
        (vLLM steps once more after a request finishes), and True: vLLM keeps the
        blocks until the workers report the store. Lazy: buffered like any plan (the
        block hashes are verified before the store), False. Never the last token: it
        was sampled, its KV never computed."""
        req_id = request.request_id
        req = self._reqs.get(req_id)
        if not self.store_decode or req is None or req_id not in self._identities:
            return False
        tokens = self._tokens(req_id, req)
        computed = getattr(request, "num_computed_tokens", 0) or 0
        end = self._round(min(computed, len(tokens) - 1, len(block_ids) * self._vllm_block))
        if end <= req.stored:
            return False  # nothing new (or preempted: no blocks)
        spec = StoreSpec(req_id, list(tokens[:end]), block_ids,
                         identity=self._identities[req_id], release=True)
        self._submit_store(req_id, req, spec, self._finish_specs)
        return self.lazy is None

    def confirmed(self, done: dict[str, int]) -> None:
        if self.lazy is not None:
            self.lazy.confirmed(done)

    def awaits_release(self) -> bool:
        """Whether lazy stores hold vLLM's blocks until every worker confirms them.
        vLLM keeps stepping an idle engine while this is true
        (``has_pending_push_work``): the empty steps carry the confirmations, and the
        blocks go back without waiting for the next request (bounded:
        ``LazyOffload.awaits_release``). Blocks a finished request keeps for an eager
        decode tail need nothing here: vLLM steps until it hears of that store."""
        return self.lazy is not None and self.lazy.awaits_release()

    def close(self) -> None:
        logger.info("lmkv scheduler counters: %s, lookup channel: %s",
                    vars(self.counters), self.client.stats())
        self.client.close()


def _known_tokens(request: Any) -> Sequence[int]:
    """A vLLM ``Request``'s tokens whose ids are known: prompt + generated
    (``all_token_ids``; sampled tokens still in flight under async scheduling are
    not in it yet), or the prompt of an object that has only that."""
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None:
        tokens = request.prompt_token_ids or []
    return tokens


def _overwritten(out: Any) -> set[int]:
    """Blocks this step's workers write before they bind the step's connector
    metadata: vLLM zeroes newly allocated blocks for some models and applies
    copy-on-write copies first."""
    blocks = set(getattr(out, "new_block_ids_to_zero", None) or ())
    blocks.update(copy.dst_block_id for copy in getattr(out, "kv_cache_block_copies", None) or ())
    return blocks
