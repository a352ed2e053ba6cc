"""What both engines decide the same way: how a chunk is named (its keys) and
whether a chunk read back fits the engine's KV spec. One place, so that a chunk
stored by a local engine is found, and checked, the same way by a remote one."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import GPUConnector, KVSpec
from lmkv.engines.protocol import EngineCounters
from lmkv.keys.chunking import CacheKey, KeyMeta, TokenChunker, kv_geometry
from lmkv.memory import dtype_name

logger = logging.getLogger(__name__)
_spec_log = RateLimitedLog(logger)


def spec_misfit(spec: KVSpec, chunk: Any, num_tokens: int) -> str | None:
    """How ``chunk`` (a tensor) differs from the shape and dtype ``spec`` gives
    ``num_tokens`` tokens, or None when it fits."""
    expected = spec.chunk_shape(num_tokens)
    if chunk.dtype == spec.dtype and tuple(chunk.shape) == expected:
        return None
    return (f"is {dtype_name(chunk.dtype)} {list(chunk.shape)}, this engine's KV is "
            f"{dtype_name(spec.dtype)} {list(expected)}")


def fits_spec(spec: KVSpec, counters: EngineCounters, key: CacheKey, chunk: Any,
              num_tokens: int) -> bool:
    """Whether ``chunk`` (a tensor) has the shape and dtype ``spec`` gives ``num_tokens``
    tokens; a chunk that does not is counted and logged (a miss for the caller)."""
    misfit = spec_misfit(spec, chunk, num_tokens)
    if misfit is None:
        return True
    counters.spec_mismatches += 1
    _spec_log.warning("spec", "lmkv: chunk %s %s; a miss from there", key.to_string(), misfit)
    return False


def hit_block_size(config: LMKVConfig, engine_block: int | None) -> int | None:
    """Tokens per block of block-granular hits: ``config.block_size``, else the
    engine's (``engine_block``: vLLM's block size, the transformers
    integration's choice). None (hits in whole chunks) when that is a whole
    chunk or does not divide one (a warning then: hits stay whole chunks)."""
    block = config.block_size or engine_block
    if not block or block >= config.chunk_size:
        return None
    if config.chunk_size % block:
        _spec_log.warning("block", "lmkv: the engine's blocks of %d tokens do not divide "
                          "chunk_size %d: hits stay whole chunks (set chunk_size to a "
                          "multiple of %d for hits at the block)", block, config.chunk_size,
                          block)
        return None
    return block


def engine_chunker(config: LMKVConfig, spec: KVSpec, model_name: str, connector: GPUConnector,
                   world_size: int, worker_id: int, block_size: int | None = None
                   ) -> TokenChunker:
    """The chunker (keys) of an engine: the same in every mode, so that engines in
    either mode name a chunk the same way. ``block_size``: the engine's block
    (``hit_block_size``)."""
    # KV replicated on several ranks (MLA on tensor-parallel ranks: vLLM numbers
    # those consecutively) is named once for all of them: by the group of ranks
    # (a pipeline stage), whose layers differ.
    replicas = max(spec.replicas, 1)
    heads_outer = replace(spec, heads_outer=True).chunk_layout
    if (spec.heads_outer or connector.chunk_layout == heads_outer) \
            and connector.chunk_layout != spec.chunk_layout:
        # one order's bytes named as the other's: scrambled KV for every engine
        # that reads them (the shapes agree when there are as many heads as planes)
        raise ValueError(f"lmkv: gpu_connector {connector.name!r} moves {connector.chunk_layout} "
                         f"chunks; this engine's KV spec holds {spec.chunk_layout} chunks")
    layout = connector.chunk_layout if spec.kv_planes == 2 else spec.chunk_layout
    meta = KeyMeta(config.model_name or model_name, max(world_size // replicas, 1),
                   worker_id // replicas, dtype_name(spec.dtype), layout,
                   kv_geometry(spec.num_layers, spec.num_kv_heads, spec.head_dim))
    return TokenChunker(meta, config.chunk_size, config.save_partial_chunk,
                        hit_block_size(config, block_size))
