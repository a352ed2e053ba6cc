"""Worker side: a cache engine (in-process, or an lmkv server's) over vLLM's paged KV caches."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from lmkv.base import affinity
from lmkv.base.errors import ConfigError
from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import ConnectorContext
from lmkv.engines import Engine, open_engine
from lmkv.engines.connector import resolve_connector_class
from lmkv.integrations.vllm.layerwise import (
    LAYER_TIMEOUT_S,
    CopyCancelled,
    LayeredConnector,
    LoadStep,
    Pace,
    StoreStep,
)
from lmkv.integrations.vllm.metadata import (
    LMKVConnectorMetadata,
    LMKVWorkerMetadata,
    LoadSpec,
    StoreSpec,
)
from lmkv.lookup.responder import LookupResponder
from lmkv.lookup.sockets import LookupEndpoints
from lmkv.memory.transfer_stream import stream_for
from lmkv.metrics import recorder
from lmkv.metrics.record import record_load, record_store

logger = logging.getLogger(__name__)


@dataclass
class WorkerCounters:
    loads: int = 0
    loaded_tokens: int = 0
    stores: int = 0
    stored_tokens: int = 0
    failed_blocks: int = 0
    layerwise_loads: int = 0  # loads copied layer by layer (lmkv.layerwise)
    rescued_stores: int = 0  # lazy rescues copied before a step's forward (lazy.py)
    layerwise_stores: int = 0  # stores copied layer by layer as the forward ran


class WorkerSide:
    def __init__(self, config: LMKVConfig, vllm_config: Any) -> None:
        self.config = config
        self.model_name = vllm_config.model_config.model
        self.head_size = vllm_config.model_config.get_head_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size  # the unit of block ids
        self.cache_config = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        self.world_size = parallel.world_size
        self.rank = getattr(parallel, "rank", 0) % max(self.world_size, 1)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        # MLA's page reads as one head of the cpu layout: named. Its latent is the
        # same on every tensor-parallel rank: keyed once for them (KVSpec.replicas).
        mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.kv_layout = "mla" if mla else None
        if mla:
            _refuse_context_parallel(parallel)
        self.kv_replicas = getattr(parallel, "tensor_parallel_size", 1) if mla else 1
        self.counters = WorkerCounters()
        self._token_bytes = 0  # KV bytes of one token in this worker's caches
        self._step_failed: set[int] = set()  # blocks this step's synchronous loads missed
        self.engine: Engine | None = None
        self.responder: LookupResponder | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._failed: set[int] = set()
        self._done: dict[str, int] = {}  # lazy stores finished since the last report
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="lmkv-lazy-store",
                                         initializer=affinity.apply_background)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmkv-async-load",
                                          initializer=affinity.apply)
        self._loaded: list[tuple[str, set[int]]] = []  # async loads finished, unreported
        self._saved: set[str] = set()  # finished requests' last stores done, unreported
        # lmkv.layerwise (layerwise.py): this step's layer-by-layer loads and stores.
        self.layered: LayeredConnector | None = None
        self.layer_timeout_s = LAYER_TIMEOUT_S
        self._layer_index: dict[str, int] = {}
        self._load_step: LoadStep | None = None
        self._store_step: StoreStep | None = None
        if config.layerwise:
            self._layer_loader = ThreadPoolExecutor(1, thread_name_prefix="lmkv-layer-load",
                                                    initializer=affinity.apply)
            self._layer_saver = ThreadPoolExecutor(1, thread_name_prefix="lmkv-layer-store",
                                                   initializer=affinity.apply)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_caches = _named_fp8(kv_caches, self.cache_config)
        self.kv_caches = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        # lmkv.gpu_connector picks another connector for vLLM's paged caches (a
        # plugin's kernels, say); by default the built-in one. The connector reads
        # the caches' layout and geometry: the worker never looks at their shapes.
        resolved = resolve_connector_class(self.config, "paged")
        spec = resolved.cls.spec_from(kv_caches=self.kv_caches, kv_layout=self.kv_layout)
        spec = replace(spec, replicas=self.kv_replicas)
        if spec.head_dim != self.head_size:
            raise ValueError(f"lmkv: the paged KV caches hold heads of {spec.head_dim} "
                             f"elements; the model's head size is {self.head_size}")
        # vLLM's CPU build may bind this thread to one CPU; lmkv's threads (started
        # from here on, the connector's copies' among them) run on every CPU of the
        # rank instead (lmkv.base.affinity).
        affinity.share(affinity.engine_cpus())
        connector = resolved.create(ConnectorContext(spec, self.kv_layout))
        if spec.heads_outer and connector.chunk_layout != spec.chunk_layout:
            # a connector that moves canonical chunks (one written for API 2.0 on
            # the paged connector's spec): canonical chunks, then
            spec = replace(spec, heads_outer=False)
            connector = resolved.create(ConnectorContext(spec, self.kv_layout))
        self._token_bytes = spec.chunk_nbytes(1)
        if self.config.layerwise:
            connector = self.layered = LayeredConnector.around(connector, resolved.create)
        self.engine = open_engine(self.config, spec, model_name=self.model_name,
                                  connector=connector,
                                  world_size=self.world_size, worker_id=self.rank,
                                  block_size=self.block_size,
                                  record_metrics=False,  # recorded here, in vLLM's terms
                                  # KV in host memory, failed loads recomputed: disk
                                  # tiers' chunks are read straight into it (DirectChunk)
                                  direct_reads=(self.kv_caches[0].device.type == "cpu"
                                                and not self.config.layerwise))
        recorder().add_tier_source(self.engine.stats)
        endpoints = LookupEndpoints.from_config(self.config.lookup, self.engine_id,
                                                self.world_size)
        self.responder = LookupResponder.for_rank(self.engine, endpoints, self.rank,
                                                  max_tokens=self.max_model_len)
        where = (f"tiers in the lmkv server at {self.config.server.address}"
                 if self.config.mode == "server" else "tiers in this process")
        logger.info("lmkv: worker %d/%d registered %d KV caches (%d KV heads of %d, %s), "
                    "block size %d, %s", self.rank, self.world_size, len(self.kv_caches),
                    spec.num_kv_heads, spec.head_dim, spec.dtype, self.block_size, where)

    def rescue(self, meta: LMKVConnectorMetadata) -> None:
        """Lazy rescues (lazy.py), when vLLM binds the step's metadata: vLLM handed
        their blocks to another request this step, and nothing of this step has
        written them yet (its zeroing and copy-on-write targets are left out by the
        scheduler; every connector's loads and the forward come after the bind).
        Each copy is done when ``_store`` returns (the connector waits for it)."""
        assert self.engine is not None, "register_kv_caches was not called"
        for spec in meta.stores:
            if spec.before_compute and self._store(spec):
                with self._lock:
                    self.counters.rescued_stores += 1

    def load(self, meta: LMKVConnectorMetadata) -> None:
        """Synchronous loads now (this step's forward reads them); asynchronous
        ones in the background, reported by ``take_finished_loads``."""
        assert self.engine is not None, "register_kv_caches was not called"
        self._finish_loads()  # (the last step's, if nothing collected them)
        self._step_failed = set()  # a new step: its synchronous loads start afresh
        # On the forward's thread: what its stream queued so far (none of this
        # step's layers yet). The loader threads' copies wait for it, not for their
        # own thread's stream; the forward reads a loaded layer only after the host
        # saw its copy done (the layer's gate, or the finished-loads report).
        ready = self._mark()
        layered = []
        for spec in meta.loads:
            if spec.async_load:
                self._loader.submit(self._load_async, spec, ready)
            elif self.layered is not None:
                layered.append(spec)
            else:  # here, on the forward's thread: its stream waits for the copy
                failed = self._load(spec)
                with self._lock:
                    self._failed |= failed
                self._step_failed |= failed
        if layered:  # the forward starts now; wait_layer holds each layer back
            step = self._load_step = LoadStep(len(self.kv_caches), self.block_size, layered)
            self._layer_loader.submit(self._load_layered, step, ready)

    def _mark(self) -> Any:
        """An event recorded now on the calling thread's current CUDA stream; called
        on vLLM's forward thread, "what the forward queued so far" on the stream it
        runs on (torch's current stream is per thread, and vLLM makes its stream
        current on that thread only). lmkv's loader and store threads order their
        copies after it (``after=``); None without CUDA."""
        if not self.kv_caches:
            return None
        return stream_for(self.kv_caches[0].device).mark()

    # -- lmkv.layerwise ------------------------------------------------------------
    def _load_layered(self, step: LoadStep, ready: Any = None) -> None:
        """The loader thread: the step's loads in order, each layer by layer; the
        last one's progress opens the layers to the forward."""
        try:
            for i, spec in enumerate(step.specs):
                progress = step.gate.advance if i == len(step.specs) - 1 else None
                failed = self._load(spec, Pace(step.guard, progress=progress,
                                               timeout_s=self.layer_timeout_s),
                                    after=ready)
                step.load_done(failed)
                with self._lock:
                    self.counters.layerwise_loads += 1
        except BaseException:  # _load catches what a load raises; this is a last resort
            logger.exception("lmkv: the layerwise loader failed")
            step.give_up()
        finally:
            step.end()

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: until this step's loads have ``layer_name``. Past
        ``layer_timeout_s`` the step's loads are given up on: their blocks are
        reported failed (vLLM recomputes them) and no copy of them runs any more."""
        step, index = self._load_step, self._layer_index.get(layer_name)
        if step is None or index is None:
            return
        if not step.gate.wait(index, self.layer_timeout_s):
            logger.warning("lmkv: layer %s not loaded within %g s; recomputing the "
                           "step's loaded blocks", layer_name, self.layer_timeout_s)
            step.give_up()

    def _finish_loads(self) -> None:
        """Collect this step's layerwise loads (their failed blocks go out with the
        step); a loader that does not finish in time is given up on."""
        step, self._load_step = self._load_step, None
        if step is None:
            return
        failed = step.failed if step.done.wait(self.layer_timeout_s) else step.give_up()
        with self._lock:
            self._failed |= failed
        self._step_failed |= failed

    def layer_saved(self, layer_name: str, meta: LMKVConnectorMetadata) -> None:
        """``save_kv_layer``: the forward wrote ``layer_name``'s KV. The first call
        of a step starts its eager stores on the store thread, each copying a layer
        once the forward produced it; ``save`` publishes them."""
        index = self._layer_index.get(layer_name)
        if self.layered is None or index is None:
            return
        step = self._store_step
        if step is None:
            step = self._store_step = StoreStep(len(self.kv_caches))
            eager = [s for s in meta.stores
                     if s.store_id is None and s.token_ids and not s.before_compute]
            if eager:
                step.future = self._layer_saver.submit(self._store_layered, step, eager,
                                                       self._load_step)
        # On the forward's stream, after the kernels that wrote this layer: the store
        # thread's copy of the layer waits for this event, not its own thread's stream.
        step.layer_produced(index, self._mark())

    def _store_layered(self, step: StoreStep, specs: list[StoreSpec],
                       loads: LoadStep | None) -> None:
        """The store thread: wait for the step's loads (a block that failed to load
        cuts the stores, ``_untainted``), then store each spec layer by layer, each
        layer's copy after the forward's event for it (``StoreStep.events``)."""
        failed: set[int] = set()
        if loads is not None:
            failed = loads.failed if loads.done.wait(self.layer_timeout_s) else loads.give_up()
        for spec in specs:
            if step.guard.cancelled:
                return
            self._store(self._untainted(spec, failed),
                        Pace(step.guard, source=step.produced, timeout_s=self.layer_timeout_s,
                             events=step.events))
            with self._lock:
                self.counters.layerwise_stores += 1

    def _finish_stores(self) -> bool:
        """Wait for this step's layerwise stores (every layer is produced once the
        forward is done); True when the step's eager stores ran that way. A store
        not done in time is cancelled (no copy runs after this returns) and dropped."""
        step, self._store_step = self._store_step, None
        if step is None or step.future is None:
            return False
        step.open_all(self._mark())  # (on the forward's thread: its forward is queued)
        try:
            step.future.result(self.layer_timeout_s)
        except Exception:
            logger.warning("lmkv: this step's layerwise stores did not finish; dropped")
            step.guard.cancel()
        return True

    def _load_async(self, spec: LoadSpec, ready: Any = None) -> None:
        failed: set[int] = set()
        try:
            failed = self._load(spec, after=ready)
        finally:  # reported even when failed: vLLM then recomputes the failed blocks
            with self._lock:
                self._loaded.append((spec.req_id, failed))

    def take_finished_loads(self) -> set[str] | None:
        """Requests whose asynchronous load finished; their failed blocks go out
        with the same step's ``take_failed_blocks`` (vLLM asks for both, in that order)."""
        with self._lock:
            if not self._loaded:
                return None
            done, self._loaded = self._loaded, []
            for _, failed in done:
                self._failed |= failed
        return {req_id for req_id, _ in done}

    def _load(self, spec: LoadSpec, pace: Pace | None = None, after: Any = None) -> set[int]:
        """Load one request's KV (layer by layer with ``pace``; after the event
        ``after`` on the forward's stream); the blocks that did not load."""
        want = len(spec.token_ids)
        start = time.perf_counter()
        paced = _paced(pace, after)
        try:
            got = self.engine.retrieve(spec.token_ids, lookup_id=spec.req_id,
                                       identity=spec.identity, kv_caches=self.kv_caches,
                                       block_ids=spec.block_ids,
                                       skip_tokens=spec.skip_tokens, **paced).num_tokens
        except CopyCancelled:  # (the step's layerwise loads were given up on)
            logger.warning("lmkv: loading request %s was given up on", spec.req_id)
            got = 0
        except Exception:
            logger.exception("lmkv: loading request %s failed", spec.req_id)
            got = 0
        failed: set[int] = set()
        if got < want:  # blocks from the first token not loaded to the end of the load
            first = max(got, spec.skip_tokens) // self.block_size
            failed = set(spec.block_ids[first:-(-want // self.block_size)])
            logger.warning("lmkv: request %s: loaded %d of %d tokens; %d blocks failed",
                           spec.req_id, got, want, len(failed))
        loaded = max(0, got - spec.skip_tokens)
        with self._lock:
            self.counters.loads += 1
            self.counters.loaded_tokens += loaded
            self.counters.failed_blocks += len(failed)
        record_load(loaded, loaded * self._token_bytes, start)
        if got < want:
            recorder().add("failed_load_tokens_total", want - max(got, spec.skip_tokens))
        return failed

    def save(self, meta: LMKVConnectorMetadata) -> None:
        """Eager stores now (vLLM may reuse their blocks once the step ends); lazy
        stores, whose blocks the scheduler protects until confirmed, in the
        background, off the step's path."""
        assert self.engine is not None, "register_kv_caches was not called"
        self._finish_loads()
        layered = self._finish_stores()  # this step's eager stores, copied meanwhile
        ready = self._mark()  # on the forward's thread: after the step's forward
        for spec in meta.stores:
            if spec.before_compute:  # copied in rescue, before this step wrote anything
                continue
            spec = self._untainted(spec, self._step_failed)
            if spec.store_id is None:
                if not layered:
                    self._store(spec, after=ready)
                if spec.release:  # reported even when failed: vLLM frees the blocks
                    with self._lock:
                        self._saved.add(spec.req_id)
            else:
                self._saver.submit(self._store_lazy, spec, ready)

    def _untainted(self, spec: StoreSpec, failed: set[int]) -> StoreSpec:
        """``spec`` cut before its first block whose load failed in this step.

        A failed block holds stale bytes, and this step's forward computed every
        later token of the request on top of them: vLLM recomputes from that block
        (``get_block_ids_with_load_errors``), but storing now would keep the wrong
        KV under the right tokens. The cut is at a block boundary; a cut to nothing
        stores nothing (the spec still confirms, so held blocks are freed)."""
        if not failed:
            return spec
        for i, block in enumerate(spec.block_ids):
            if block in failed:
                cut = min(len(spec.token_ids), i * self.block_size)
                if cut < len(spec.token_ids):
                    logger.warning("lmkv: request %s: not storing past token %d (a block "
                                   "it reads failed to load this step)", spec.req_id, cut)
                    return replace(spec, token_ids=spec.token_ids[:cut])
                return spec
        return spec

    def _store(self, spec: StoreSpec, pace: Pace | None = None, after: Any = None) -> bool:
        """Store ``spec``; False when it failed (logged)."""
        if not spec.token_ids:
            return True
        start = time.perf_counter()
        paced = _paced(pace, after)
        try:
            n = self.engine.store(spec.token_ids, identity=spec.identity,
                                  kv_caches=self.kv_caches, block_ids=spec.block_ids, **paced)
            with self._lock:
                self.counters.stores += 1
                self.counters.stored_tokens += n
            record_store(n, n * self._token_bytes, start)
        except Exception:
            logger.exception("lmkv: storing request %s failed", spec.req_id)
            return False
        return True

    def _store_lazy(self, spec: StoreSpec, ready: Any = None) -> None:
        self._store(spec, after=ready)
        with self._lock:  # confirmed even when failed: frees the blocks
            self._done[spec.store_id] = 1

    def take_finished_saves(self) -> set[str] | None:
        """Finished requests whose last store (``StoreSpec.release``) is done."""
        with self._lock:
            if not self._saved:
                return None
            done, self._saved = self._saved, set()
        return done

    def take_worker_meta(self) -> LMKVWorkerMetadata | None:
        with self._lock:
            if not self._done:
                return None
            done, self._done = self._done, {}
        return LMKVWorkerMetadata(done)

    def take_failed_blocks(self) -> set[int]:
        self._finish_loads()  # (wait_for_save may come later: speculative decoding)
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        try:
            self._loader.shutdown(wait=True)
            if self.config.layerwise:
                self._layer_loader.shutdown(wait=True)
                self._layer_saver.shutdown(wait=True)
            self._saver.shutdown(wait=True)  # lazy stores in flight finish first
            logger.info("lmkv worker counters: %s", vars(self.counters))
            if self.responder is not None:
                self.responder.close()
        finally:  # the engine's connections and threads end whatever failed before
            if self.engine is not None:
                self.engine.close()


# vLLM allocates these KV caches as bytes (torch.uint8), whatever the format: the
# caches are viewed (the same memory) as the format they hold, so that the
# chunk's key names it (keys carry the dtype) and e4m3 and e5m2 never share keys.
_FP8_VIEWS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def _named_fp8(kv_caches: dict[str, torch.Tensor], cache_config: Any
               ) -> dict[str, torch.Tensor]:
    """``kv_caches`` viewed as their fp8 format when vLLM allocated them as bytes.

    ConfigError (one line) for what bytes cannot name: another format vLLM keeps
    in uint8 (packed or with scales inside), or fp8 scales computed per run
    (``calculate_kv_scales``, older vLLMs): equal tokens would give different
    bytes under the same key."""
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype.startswith("fp8") and getattr(cache_config, "calculate_kv_scales", False):
        raise ConfigError(f"lmkv: cache_dtype {cache_dtype} with calculate_kv_scales is not "
                          "supported: the scales differ per run, so equal tokens give "
                          "different KV; allowed: calculate_kv_scales off (fixed scales)")
    first = next(iter(kv_caches.values()), None)
    if first is None or first.dtype != torch.uint8:
        return kv_caches
    view = _FP8_VIEWS.get(cache_dtype)
    if view is None:
        raise ConfigError(f"lmkv: cache_dtype {cache_dtype} (KV kept as bytes) is not "
                          f"supported; allowed: auto, float16, bfloat16, "
                          f"{', '.join(_FP8_VIEWS)}")
    return {name: cache.view(view) for name, cache in kv_caches.items()}


def _refuse_context_parallel(parallel: Any) -> None:
    """MLA keys a tensor-parallel group's latent once (``KVSpec.replicas``): right
    only while every rank of the group holds every token. Context parallelism
    (vLLM's decode_/prefill_context_parallel_size) shards the tokens over those
    ranks: one key would then name different KV on each. Refused, not guessed."""
    sizes = {name: int(getattr(parallel, name, 1) or 1)
             for name in ("decode_context_parallel_size", "prefill_context_parallel_size")}
    bad = [f"{name}={n}" for name, n in sizes.items() if n > 1]
    if bad:
        raise ConfigError(f"lmkv: an MLA model with context parallelism ({', '.join(bad)}) "
                          "is not supported: its ranks hold different tokens under one key; "
                          "allowed: decode_context_parallel_size and "
                          "prefill_context_parallel_size 1")


def _paced(pace: Pace | None, after: Any) -> dict[str, Any]:
    """The connector keywords a copy adds: its ``pace`` (layerwise) and ``after``
    (an event on the forward's stream), each only when set."""
    kw: dict[str, Any] = {}
    if pace is not None:
        kw["pace"] = pace
    if after is not None:
        kw["after"] = after
    return kw
