"""``LMKVConnector``: vLLM's ``KVConnectorBase_V1`` over lmkv (thin; see scheduler.py
and worker.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from lmkv.base.logutil import log_where_nothing_does
from lmkv.integrations.vllm.config import config_from_extra
from lmkv.integrations.vllm.events import (
    SchedulerEvents,
    WorkerEvents,
    block_names,
    events_enabled,
)
from lmkv.integrations.vllm.identity import check_kv_cache_groups
from lmkv.integrations.vllm.metadata import LMKVConnectorMetadata, LMKVWorkerMetadata
from lmkv.integrations.vllm.stats import LMKVPromMetrics, LMKVStats, StatsTaker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class LMKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_where_nothing_does()  # vLLM's logging covers only its own loggers
        config = config_from_extra(self._kv_transfer_config.kv_connector_extra_config)
        check_kv_cache_groups(kv_cache_config, vllm_config.model_config.model,
                              (FullAttentionSpec, MLAAttentionSpec))
        if config.lazy_offload and not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("lmkv.lazy_offload needs vLLM's prefix caching (the block "
                             "hashes it verifies); enable it or turn lazy offload off")
        self.lmkv_config = config
        if config.save_partial_chunk:
            logger.warning("lmkv.save_partial_chunk has no effect in the vLLM connector: it "
                           "stores and loads whole chunks (vLLM recomputes the rest)")
        self.scheduler_side = self.worker_side = None
        # KV events (events.py): only when vLLM publishes them (--kv-events-config).
        self.events_on = events_enabled(vllm_config)
        if self.events_on and config.mode == "server":  # the tiers' evictions are not seen
            self.events_on = False
            if role == KVConnectorRole.SCHEDULER:
                logger.warning("lmkv: vLLM publishes KV events, but lmkv's tiers are in an "
                               "lmkv server: lmkv publishes none (docs/vllm.md, KV events)")
        self.worker_events: WorkerEvents | None = None
        self.scheduler_events: SchedulerEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            from lmkv.integrations.vllm.scheduler import SchedulerSide
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", None) == "fail":
                logger.warning(
                    "lmkv: vLLM's kv_load_failure_policy is 'fail': a chunk lmkv cannot load "
                    "(evicted or corrupted meanwhile, a tier down) fails its request; add "
                    "\"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config to "
                    "recompute those blocks instead")
            lazy = None
            if config.lazy_offload:
                from lmkv.integrations.vllm.lazy import LazyOffload
                lazy = LazyOffload(config, block_size=vllm_config.cache_config.block_size,
                                   world_size=vllm_config.parallel_config.world_size,
                                   block_hash_of=_block_hash_of)
            self.scheduler_side = SchedulerSide(config, vllm_config, lazy)
            if self.events_on:
                self.scheduler_side.name_blocks = functools.partial(
                    block_names, block_size=vllm_config.cache_config.block_size)
                self.scheduler_events = SchedulerEvents(vllm_config.parallel_config.world_size)
        else:
            from lmkv.integrations.vllm.worker import WorkerSide
            self.worker_side = WorkerSide(config, vllm_config)
        self._stats = StatsTaker(self.worker_side.rank if self.worker_side else None)
        logger.info("lmkv connector (%s) ready: chunk size %d, %s offload%s", role.name,
                    config.chunk_size, "lazy" if config.lazy_offload else "eager",
                    ", layerwise loads and stores" if config.layerwise else "")

    # -- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)
        if self.events_on:
            self.worker_events = WorkerEvents.attach(self.worker_side.engine,
                                                     self.worker_side.block_size)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds each step's metadata before any connector's ``start_load_kv``
        and before the forward: lazy rescues are copied here (``WorkerSide.rescue``)."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if self.worker_side is None or not isinstance(meta, LMKVConnectorMetadata):
            return
        rescues = [s for s in meta.stores if s.before_compute]
        if rescues:
            if self.worker_events is not None:  # before the tiers hear of the chunks
                self.worker_events.name(rescues)
            self.worker_side.rescue(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.lmkv_config.layerwise:  # else the loads finished in start_load_kv
            self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self.lmkv_config.layerwise:  # else whole-model stores in wait_for_save
            self.worker_side.layer_saved(layer_name, self._meta())

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """The per-layer waits and saves of ``lmkv.layerwise`` run between graph pieces."""
        try:
            return config_from_extra(extra_config).layerwise
        except Exception:  # a bad config fails with its one line where vLLM builds us
            return False

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self.worker_events is not None:
            self.worker_events.name(meta.stores)  # before the tiers hear of the chunks
        self.worker_side.save(meta)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.worker_events.take() if self.worker_events is not None else None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose last decode store (``store_decode``) is done: vLLM
        frees their blocks, requests whose asynchronous load finished since the
        last call)."""
        if self.worker_side is None:
            return None, None
        return self.worker_side.take_finished_saves(), self.worker_side.take_finished_loads()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks() if self.worker_side else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.take_worker_meta() if self.worker_side else None

    def _meta(self) -> LMKVConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMKVConnectorMetadata)
        return meta

    # -- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)
        return n, bool(n) and self.lmkv_config.async_load

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self.scheduler_side.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        plan = self.scheduler_side.build_meta(scheduler_output)
        return LMKVConnectorMetadata(plan.loads, plan.stores)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        lazy = self.scheduler_side.lazy if self.scheduler_side else None
        if lazy is not None:
            lazy.pool = kv_cache_manager.block_pool

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, LMKVWorkerMetadata):
            self.scheduler_side.confirmed(meta.done)
        if self.scheduler_events is not None:
            self.scheduler_events.collect(getattr(connector_output, "kv_cache_events", None))

    def has_pending_push_work(self) -> bool:
        """True while lazy stores hold blocks the workers have not confirmed: vLLM's
        engine loop keeps stepping an idle engine, so they go back without waiting
        for the next request (``SchedulerSide.awaits_release``)."""
        return self.scheduler_side is not None and self.scheduler_side.awaits_release()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler_events.take() if self.scheduler_events is not None else ()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM keeps the blocks until ``get_finished`` reports the request) only
        when an eager ``store_decode`` store of the request's tail is planned."""
        return self.scheduler_side.finished(request, block_ids), None

    # -- metrics (vLLM's connector stats: /metrics and the periodic log line) -------
    def get_kv_connector_stats(self) -> LMKVStats | None:
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMKVStats:
        return LMKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LMKVPromMetrics:
        return LMKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_events is not None:
            self.worker_events.close()
        for side in (self.scheduler_side, self.worker_side):
            if side is not None:
                side.close()


def _block_hash_of(pool_hash: Any) -> Any:
    """The request-side block hash of a pool block's hash (which carries its group id)."""
    return get_block_hash(pool_hash)
