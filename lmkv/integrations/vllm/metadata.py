"""What the scheduler tells the workers each step: loads and stores by block ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load ``token_ids`` (the stored prefix) into ``block_ids``; tokens below
    ``skip_tokens`` are already in vLLM's cache (its own prefix hit)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int = 0


@dataclass
class StoreSpec:
    """Store the whole chunks of ``token_ids`` from ``block_ids``."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class LMKVConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
