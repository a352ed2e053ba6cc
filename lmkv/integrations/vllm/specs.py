"""Plain load/store plans shared by the scheduler and the workers (no vLLM import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkv.keys.chunking import Identity


@dataclass
class LoadSpec:
    """Load ``token_ids`` (the stored prefix) into ``block_ids``; tokens below
    ``skip_tokens`` are already in vLLM's cache (its own prefix hit). An
    ``async_load`` runs in the background; the worker reports it finished.
    ``identity``: what besides the tokens names the request's chunks."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int = 0
    async_load: bool = False
    identity: Identity | None = None


@dataclass
class BlockNames:
    """vLLM's names of a request's blocks, for the KV events of what lmkv stores
    (``events.py``): ``hashes[i]`` is block ``i``'s hash as vLLM publishes it;
    the LoRA adapter and the per-block extra keys as vLLM's own ``BlockStored``
    carries them (``extra_keys`` None when no block has any)."""

    hashes: list[Any]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


@dataclass
class StoreSpec:
    """Store the whole chunks of ``token_ids`` from ``block_ids``. Lazy stores carry a
    ``store_id`` the workers confirm (the scheduler then releases the blocks).
    ``release``: a finished request's last store (``store_decode``), whose blocks
    vLLM keeps until every worker reported it done (``get_finished``).
    ``before_compute``: a lazy rescue (``lazy.py``): vLLM handed the blocks to
    another request this step, so the workers copy them when vLLM binds the
    step's metadata, before the step's loads and forward write them."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    store_id: str | None = None
    identity: Identity | None = None
    release: bool = False
    before_compute: bool = False
    blocks: BlockNames | None = None  # set only when vLLM publishes KV events


@dataclass
class StepPlan:
    """What the scheduler plans for one step (the connector wraps it as vLLM metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
