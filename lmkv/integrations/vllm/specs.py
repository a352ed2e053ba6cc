"""Plain load/store plans shared by the scheduler and the workers (no vLLM import)."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Store the whole chunks of ``token_ids`` from ``block_ids``. Lazy stores carry a
    ``store_id`` the workers confirm (the scheduler then releases the blocks)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    store_id: str | None = None
