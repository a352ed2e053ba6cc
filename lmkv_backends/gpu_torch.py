"""Torch GPU connectors: transformers-style per-layer tensors and vLLM paged caches.

Both copy between an engine's KV and lmkv's chunk buffers
``[layers, 2, tokens, kv_heads, head_dim]``; they work on any torch device
(gathers run on the cache's device, then one copy per layer crosses to the
host buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from lmkv.gpu import ChunkSpan, GPUConnector
from lmkv.plugins.base import PluginOptions

KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class HFConnector(GPUConnector):
    """Per-layer ``(K, V)`` tensors of shape ``[batch, kv_heads, seq, head_dim]``.

    Keyword arguments: ``kv`` (one ``(K, V)`` pair per layer) and
    ``batch_index`` (default 0). ``from_chunks`` without ``kv`` builds new
    tensors of shape ``[1, kv_heads, end, head_dim]`` for the spans'
    tokens and returns them; with ``kv`` it writes into those tensors.
    """

    name = "hf"

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv: KVPairs,
                  batch_index: int = 0, **_: Any) -> None:
        for span in spans:
            buf = span.buffer
            for layer, (k, v) in enumerate(kv):
                buf[layer, 0].copy_(k[batch_index, :, span.start:span.end].transpose(0, 1))
                buf[layer, 1].copy_(v[batch_index, :, span.start:span.end].transpose(0, 1))

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv: KVPairs | None = None,
                    batch_index: int = 0, device: torch.device | str | None = None,
                    **_: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = self.spec
        if kv is None:
            total = max((s.end for s in spans), default=0)
            shape = (1, spec.num_kv_heads, total, spec.head_dim)
            kv = [(torch.empty(shape, dtype=spec.dtype, device=device),
                   torch.empty(shape, dtype=spec.dtype, device=device))
                  for _ in range(spec.num_layers)]
            batch_index = 0
        for span in spans:
            buf = span.buffer
            for layer, (k, v) in enumerate(kv):
                k[batch_index, :, span.start:span.end].copy_(buf[layer, 0].transpose(0, 1))
                v[batch_index, :, span.start:span.end].copy_(buf[layer, 1].transpose(0, 1))
        return list(kv)


class PagedOptions(PluginOptions):
    layout: Literal["flash", "cpu"] = "flash"
    """``flash``: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``
    (FlashAttention). ``cpu``: per layer ``[num_blocks, kv_heads, block_size,
    2 * head_dim]`` (vLLM's CPU backend, K and V side by side)."""


class PagedConnector(GPUConnector):
    """vLLM-style paged KV caches addressed by block ids.

    Keyword arguments: ``kv_caches`` (one tensor per layer, in ``layout``)
    and ``block_ids`` (the request's block table: token ``t`` lives in block
    ``block_ids[t // block_size]`` at offset ``t % block_size``). Partial
    blocks and chunks that straddle blocks are fine.
    """

    name = "paged"
    Options = PagedOptions

    def _slots(self, span: ChunkSpan, block_ids: Sequence[int] | torch.Tensor,
               block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.arange(span.start, span.end, device=device)
        table = torch.as_tensor(block_ids, dtype=torch.long, device=device)
        return table[tokens // block_size], tokens % block_size

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int] | torch.Tensor, **_: Any) -> None:
        first = kv_caches[0]
        block_size = first.shape[2]  # both layouts keep block_size at dim 2
        head_dim = self.spec.head_dim
        for span in spans:
            blocks, offsets = self._slots(span, block_ids, block_size, first.device)
            buf = span.buffer
            for layer, cache in enumerate(kv_caches):
                if self.options.layout == "flash":
                    # [2, NB, BS, H, D] -> [2, T, H, D]
                    _copy(buf[layer], cache[:, blocks, offsets])
                else:
                    # [NB, H, BS, 2D] -> [T, H, 2D]
                    gathered = cache[blocks, :, offsets]
                    _copy(buf[layer, 0], gathered[..., :head_dim])
                    _copy(buf[layer, 1], gathered[..., head_dim:])

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                    block_ids: Sequence[int] | torch.Tensor, **_: Any) -> None:
        first = kv_caches[0]
        block_size = first.shape[2]  # both layouts keep block_size at dim 2
        head_dim = self.spec.head_dim
        for span in spans:
            blocks, offsets = self._slots(span, block_ids, block_size, first.device)
            buf = span.buffer
            for layer, cache in enumerate(kv_caches):
                src = buf[layer].to(cache.device, non_blocking=True)
                if self.options.layout == "flash":
                    cache[:, blocks, offsets] = src
                else:
                    cache[blocks, :, offsets, :head_dim] = src[0]
                    cache[blocks, :, offsets, head_dim:] = src[1]
        return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=src.device.type != "cpu")
