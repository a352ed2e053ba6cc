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


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _sync(device: torch.device) -> None:
    """Wait for asynchronous copies on ``device`` (pinned-memory transfers)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class HFConnector(GPUConnector):
    """Per-layer ``(K, V)`` tensors of shape ``[batch, kv_heads, seq, head_dim]``.

    Keyword arguments: ``kv`` (one ``(K, V)`` pair per layer) and
    ``batch_index`` (default 0). ``from_chunks`` without ``kv`` builds new
    tensors of shape ``[1, kv_heads, end, head_dim]`` for the spans'
    tokens and returns them; with ``kv`` it writes into those tensors.
    """

    name = "hf"
    engine_kind = "hf"

    def _validate(self, kv: KVPairs, end: int, batch_index: int) -> None:
        spec = self.spec
        _check(len(kv) == spec.num_layers,
               f"KV has {len(kv)} layers; this engine stores {spec.num_layers}")
        for k, v in kv:
            for t in (k, v):
                _check(t.dim() == 4 and t.shape[1] == spec.num_kv_heads
                       and t.shape[3] == spec.head_dim,
                       f"KV tensor of shape {tuple(t.shape)}; expected [batch, "
                       f"{spec.num_kv_heads}, seq, {spec.head_dim}]")
                _check(t.dtype == spec.dtype, f"KV dtype {t.dtype}; expected {spec.dtype}")
                _check(t.shape[2] >= end, f"KV holds {t.shape[2]} tokens; {end} needed")
                _check(0 <= batch_index < t.shape[0], f"batch_index {batch_index} out of range")

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv: KVPairs,
                  batch_index: int = 0, **_: Any) -> None:
        self._validate(kv, max((s.end for s in spans), default=0), batch_index)
        for span in spans:
            buf = span.buffer
            for layer, (k, v) in enumerate(kv):
                buf[layer, 0].copy_(k[batch_index, :, span.start:span.end].transpose(0, 1),
                                    non_blocking=True)
                buf[layer, 1].copy_(v[batch_index, :, span.start:span.end].transpose(0, 1),
                                    non_blocking=True)
        if kv:
            _sync(kv[0][0].device)

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
        self._validate(kv, max((s.end for s in spans), default=0), batch_index)
        for span in spans:
            buf = span.buffer
            for layer, (k, v) in enumerate(kv):
                k[batch_index, :, span.start:span.end].copy_(buf[layer, 0].transpose(0, 1),
                                                             non_blocking=True)
                v[batch_index, :, span.start:span.end].copy_(buf[layer, 1].transpose(0, 1),
                                                             non_blocking=True)
        if kv:
            _sync(kv[0][0].device)  # the chunk buffers are released after this returns
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
    engine_kind = "paged"
    writes_in_place = True
    Options = PagedOptions

    def _validate(self, kv_caches: Sequence[torch.Tensor], block_ids: Any, end: int) -> int:
        """Check the caches against the spec; returns the block size."""
        spec = self.spec
        _check(len(kv_caches) == spec.num_layers,
               f"{len(kv_caches)} KV caches; this engine stores {spec.num_layers} layers")
        first = kv_caches[0]
        if self.options.layout == "flash":
            expected = (2, first.shape[1], first.shape[2], spec.num_kv_heads, spec.head_dim)
            form = "[2, num_blocks, block_size, kv_heads, head_dim]"
        else:
            expected = (first.shape[0], spec.num_kv_heads, first.shape[2], 2 * spec.head_dim)
            form = "[num_blocks, kv_heads, block_size, 2 * head_dim]"
        for cache in kv_caches:
            _check(tuple(cache.shape) == expected,
                   f"KV cache of shape {tuple(cache.shape)}; the {self.options.layout} layout "
                   f"is {form} = {expected}")
            _check(cache.dtype == spec.dtype, f"KV dtype {cache.dtype}; expected {spec.dtype}")
        block_size = first.shape[2]
        _check(len(block_ids) * block_size >= end,
               f"{len(block_ids)} blocks of {block_size} tokens cannot hold {end} tokens")
        return block_size

    @staticmethod
    def _runs(span: ChunkSpan, block_ids: Sequence[int] | torch.Tensor,
              block_size: int) -> list[tuple[int, int, int, int, int]]:
        """(block id, first offset, end offset, first token, end token) of each
        block the span touches; tokens are relative to the span."""
        runs = []
        t = span.start
        while t < span.end:
            offset = t % block_size
            n = min(block_size - offset, span.end - t)
            block = int(block_ids[t // block_size])
            runs.append((block, offset, offset + n, t - span.start, t - span.start + n))
            t += n
        return runs

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int] | torch.Tensor, **_: Any) -> None:
        end = max((s.end for s in spans), default=0)
        block_size = self._validate(kv_caches, block_ids, end)
        flash = self.options.layout == "flash"
        d = self.spec.head_dim
        for span in spans:
            runs = self._runs(span, block_ids, block_size)
            buf = span.buffer
            for layer, cache in enumerate(kv_caches):
                for block, o0, o1, t0, t1 in runs:
                    if flash:  # [2, NB, BS, H, D] -> [2, T, H, D]
                        _copy(buf[layer, :, t0:t1], cache[:, block, o0:o1])
                    else:  # [NB, H, BS, 2D] -> [T, H, D] twice
                        part = cache[block, :, o0:o1].transpose(0, 1)
                        _copy(buf[layer, 0, t0:t1], part[..., :d])
                        _copy(buf[layer, 1, t0:t1], part[..., d:])
        if kv_caches:
            _sync(kv_caches[0].device)  # the buffers are published to other threads next

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                    block_ids: Sequence[int] | torch.Tensor, skip_tokens: int = 0,
                    **_: Any) -> None:
        """``skip_tokens``: leave the request's first tokens alone (the engine
        already holds them, possibly in blocks other requests share)."""
        end = max((s.end for s in spans), default=0)
        block_size = self._validate(kv_caches, block_ids, end)
        flash = self.options.layout == "flash"
        d = self.spec.head_dim
        for span in spans:
            runs = self._runs(span, block_ids, block_size)
            if skip_tokens > span.start:
                runs = _clip(runs, skip_tokens - span.start)
            for layer, cache in enumerate(kv_caches):
                src = span.buffer[layer].to(cache.device, non_blocking=True)  # one transfer
                for block, o0, o1, t0, t1 in runs:
                    if flash:
                        cache[:, block, o0:o1].copy_(src[:, t0:t1])
                    else:
                        part = cache[block, :, o0:o1]  # [H, n, 2D]
                        part[..., :d].copy_(src[0, t0:t1].transpose(0, 1))
                        part[..., d:].copy_(src[1, t0:t1].transpose(0, 1))
        if kv_caches:
            _sync(kv_caches[0].device)  # the chunk buffers are released after this returns
        return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=src.device.type != "cpu")


def _clip(runs: list[tuple[int, int, int, int, int]],
          skip: int) -> list[tuple[int, int, int, int, int]]:
    """``runs`` without their first ``skip`` tokens (relative to the span)."""
    out = []
    for block, o0, o1, t0, t1 in runs:
        if t1 <= skip:
            continue
        cut = max(0, skip - t0)
        out.append((block, o0 + cut, o1, t0 + cut, t1))
    return out
