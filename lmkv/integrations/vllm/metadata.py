"""vLLM metadata: scheduler -> workers (loads, stores) and workers -> scheduler
(confirmed lazy stores)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from lmkv.integrations.vllm.specs import LoadSpec, StoreSpec

__all__ = ["LMKVConnectorMetadata", "LMKVWorkerMetadata", "LoadSpec", "StoreSpec"]


@dataclass
class LMKVConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass
class LMKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Lazy stores this step finished (or gave up on): store id -> number of workers."""

    done: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LMKVWorkerMetadata)
        done = dict(self.done)
        for store_id, n in other.done.items():
            done[store_id] = done.get(store_id, 0) + n
        return LMKVWorkerMetadata(done)
