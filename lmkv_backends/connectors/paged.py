"""vLLM-style paged KV caches, copied to and from lmkv's chunk buffers
``[layers, 2, tokens, kv_heads, head_dim]`` by the ``lmkv_kernels`` copies.

The connector checks what it is given (once a call, one line when wrong) and
reads the caches' layout from their shapes (``lmkv_kernels.layouts``): the
vLLM worker asks it (``PagedConnector.spec_from``) instead of telling it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import lmkv_kernels
from lmkv.gpu import ChunkSpan, GPUConnector, KVSpec
from lmkv.transfer_stream import stream_for
from lmkv_backends.connectors.common import check
from lmkv_kernels.layouts import shape_of


class PagedConnector(GPUConnector):
    """vLLM-style paged KV caches addressed by block ids.

    Keyword arguments: ``kv_caches`` (one tensor per layer, all in one layout:
    ``flash`` ``[2, num_blocks, block_size, kv_heads, head_dim]`` or ``cpu``
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, read from the shapes)
    and ``block_ids`` (the request's block table: token ``t`` lives in block
    ``block_ids[t // block_size]`` at offset ``t % block_size``). Partial
    blocks and chunks that straddle blocks are fine.
    """

    name = "paged"
    kv_kind = "paged"
    writes_in_place = True

    @classmethod
    def spec_from(cls, *, kv_caches: Sequence[torch.Tensor], **_: Any) -> KVSpec:
        """The spec of vLLM's paged caches, their layout read from their shapes."""
        check(len(kv_caches) > 0, "no KV caches; expected one paged cache per layer")
        g = lmkv_kernels.geometry(kv_caches[0])
        return KVSpec(len(kv_caches), g.kv_heads, g.head_dim, kv_caches[0].dtype)

    def _validate(self, kv_caches: Sequence[torch.Tensor], block_ids: Any, end: int) -> None:
        """Check the caches against the spec and the block table against ``end``."""
        spec = self.spec
        check(len(kv_caches) == spec.num_layers,
              f"{len(kv_caches)} KV caches; this engine stores {spec.num_layers} layers")
        g = lmkv_kernels.geometry(kv_caches[0])
        expected = shape_of(g.layout, g.num_blocks, g.block_size, spec.num_kv_heads,
                            spec.head_dim)
        for cache in kv_caches:
            if cache.shape == expected and cache.dtype == spec.dtype:
                continue  # (the messages cost more than the checks on this hot path)
            check(tuple(cache.shape) == expected,
                  f"KV cache of shape {tuple(cache.shape)}; the {g.layout} layout "
                  f"is {g.form} = {expected}")
            check(cache.dtype == spec.dtype, f"KV dtype {cache.dtype}; expected {spec.dtype}")
        check(len(block_ids) * g.block_size >= end,
              f"{len(block_ids)} blocks of {g.block_size} tokens cannot hold {end} tokens")
        used = block_ids[:-(-end // g.block_size)]
        if len(used):  # a negative or too large id would wrap into another request's block
            low, high = (int(used.min()), int(used.max())) if isinstance(used, torch.Tensor) \
                else (min(used), max(used))
            check(low >= 0 and high < g.num_blocks,
                  f"block ids {low}..{high} out of range: the caches hold {g.num_blocks} blocks")

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int] | torch.Tensor, **_: Any) -> None:
        self._validate(kv_caches, block_ids, max((s.end for s in spans), default=0))
        chunks = [(s.start, s.buffer) for s in spans]
        # On the transfer stream, after the forward that wrote the KV (lmkv.transfer_stream);
        # the buffers are published to tiers and other threads next: after its event.
        stream_for(kv_caches[0].device).store(
            lambda: lmkv_kernels.gather_blocks(kv_caches, block_ids, chunks)).wait()

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                    block_ids: Sequence[int] | torch.Tensor, skip_tokens: int = 0,
                    **_: Any) -> None:
        """``skip_tokens``: leave the request's first tokens alone (the engine
        already holds them, possibly in blocks other requests share)."""
        self._validate(kv_caches, block_ids, max((s.end for s in spans), default=0))
        chunks = [(s.start, s.buffer) for s in spans]
        # The compute stream's later kernels wait for the copy on the GPU; the chunk
        # buffers are released after this returns: after its event.
        stream_for(kv_caches[0].device).load(
            lambda: lmkv_kernels.scatter_blocks(kv_caches, block_ids, chunks,
                                                skip_tokens)).wait()
        return None
