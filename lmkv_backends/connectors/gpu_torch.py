"""Torch GPU connectors: transformers-style per-layer tensors and vLLM paged caches.

Both copy between an engine's KV and lmkv's chunk buffers
``[layers, 2, tokens, kv_heads, head_dim]``; they work on any torch device
(the paged connector gathers on the cache's device, then one copy per chunk
crosses to the host buffer).
"""

from __future__ import annotations

import functools
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

    Copies are few and long: one per layer and chunk where rows can be
    gathered by index, else one per run of consecutive block ids
    (``benchmarks/bench_paged.py`` measures them against a memcpy).
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
            if cache.shape == expected and cache.dtype == spec.dtype:
                continue  # (the messages cost more than the checks on this hot path)
            _check(tuple(cache.shape) == expected,
                   f"KV cache of shape {tuple(cache.shape)}; the {self.options.layout} layout "
                   f"is {form} = {expected}")
            _check(cache.dtype == spec.dtype, f"KV dtype {cache.dtype}; expected {spec.dtype}")
        block_size = first.shape[2]
        _check(len(block_ids) * block_size >= end,
               f"{len(block_ids)} blocks of {block_size} tokens cannot hold {end} tokens")
        return block_size

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` viewed as ``[2, num_blocks, block_size, kv_heads, head_dim]``, the
        chunk buffer's order, so one slice addresses a run of blocks in either layout."""
        if self.options.layout == "flash":
            return cache
        num_blocks, heads, block_size, _ = cache.shape
        return cache.view(num_blocks, heads, block_size, 2, -1).permute(3, 0, 2, 1, 4)

    def _rows(self, kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each cache as a table of rows, or None unless all are contiguous. cpu
        layout: rows of ``head_dim`` elements, K or V of one head and token (row
        ``((block * kv_heads + head) * block_size + offset) * 2 + kv``); flash: rows
        of ``kv_heads * head_dim``, K or V of one token (row ``(kv * num_blocks +
        block) * block_size + offset``). Copying whole rows by index
        (``index_select``) runs at about memcpy speed, where a strided ``copy_``
        runs short inner loops on the cpu layout (1.3-2x slower) and takes a copy
        per block of a fragmented block table."""
        if not all(cache.is_contiguous() for cache in kv_caches):
            return None
        row = self.spec.head_dim
        if self.options.layout == "flash":
            row *= self.spec.num_kv_heads
        return [cache.view(-1, row) for cache in kv_caches]

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                  block_ids: Sequence[int] | torch.Tensor, **_: Any) -> None:
        end = max((s.end for s in spans), default=0)
        block_size = self._validate(kv_caches, block_ids, end)
        device, d, heads = kv_caches[0].device, self.spec.head_dim, self.spec.num_kv_heads
        rows = self._rows(kv_caches)
        if rows:
            token_rows, kv_head_rows = self._gather_index(block_ids, end, kv_caches[0])
        ids = _as_list(block_ids)
        for span in spans:
            buf = span.buffer
            # gather on the cache's device, then one transfer to the host buffer
            out = buf if buf.device == device else torch.empty_like(buf, device=device)
            if rows and out.is_contiguous():  # one gather per layer, whatever the table
                index = (token_rows[span.start:span.end] + kv_head_rows).view(-1)
                for layer, cache_rows in enumerate(rows):
                    torch.index_select(cache_rows, 0, index,
                                       out=out[layer].view(-1, cache_rows.shape[1]))
            else:
                pieces = _pieces(span.start, span.end, ids, block_size)
                for layer, cache in enumerate(kv_caches):  # layer by layer: reads in order
                    for block, count, offset, length, t in pieces:
                        t0 = t - span.start
                        part = out[layer, :, t0:t0 + count * length]
                        part = part.view(2, count, length, heads, d)
                        part.copy_(self._blocks(cache)[:, block:block + count,
                                                       offset:offset + length])
            if out is not buf:
                buf.copy_(out, non_blocking=True)
        _sync(device)  # the buffers are published to other threads next

    def _gather_index(self, block_ids: Sequence[int] | torch.Tensor, end: int,
                      cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_rows [end, 1], kv_head_rows [2, 1, kv_heads or 1])``: their sum is
        the cache row (see ``_rows``) of each row of a chunk buffer in that order."""
        blocks = self._blocks(cache)
        num_blocks, block_size, heads = blocks.shape[1:4]
        n_blocks = -(-end // block_size)
        ids = torch.as_tensor(block_ids[:n_blocks]).to(cache.device, torch.int64)[:, None]
        offsets = torch.arange(block_size, device=cache.device)
        kv = torch.arange(2, device=cache.device)[:, None, None]
        if self.options.layout == "flash":
            token_rows = ids * block_size + offsets
            kv_head_rows = kv * (num_blocks * block_size)
        else:
            token_rows = (ids * (heads * block_size) + offsets) * 2
            kv_head_rows = kv + torch.arange(heads, device=cache.device) * (2 * block_size)
        return token_rows.view(-1, 1)[:end], kv_head_rows

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv_caches: Sequence[torch.Tensor],
                    block_ids: Sequence[int] | torch.Tensor, skip_tokens: int = 0,
                    **_: Any) -> None:
        """``skip_tokens``: leave the request's first tokens alone (the engine
        already holds them, possibly in blocks other requests share)."""
        end = max((s.end for s in spans), default=0)
        block_size = self._validate(kv_caches, block_ids, end)
        device, d, heads = kv_caches[0].device, self.spec.head_dim, self.spec.num_kv_heads
        ids = _as_list(block_ids)
        loads = [(span, _pieces(max(span.start, skip_tokens), span.end, ids, block_size))
                 for span in spans if span.end > skip_tokens]
        rows = self._rows(kv_caches)
        # small or scattered blocks (over two copies a layer): one scatter per layer
        scatter = bool(rows) and any(len(pieces) > 2 for _, pieces in loads)
        if scatter:
            token_rows, kv_head_rows = self._gather_index(block_ids, end, kv_caches[0])
        cpu_rows = rows if self.options.layout == "cpu" else None
        block_rows = 2 * heads * block_size
        for span, pieces in loads:
            src = span.buffer.to(device, non_blocking=True)  # one transfer
            if scatter and len(pieces) > 2:
                first = max(span.start, skip_tokens)
                index = (token_rows[first:span.end] + kv_head_rows).view(-1)
                part = src[:, :, first - span.start:]
                for layer, cache_rows in enumerate(rows):
                    _scatter(cache_rows, index, part[layer].reshape(-1, cache_rows.shape[1]))
                continue
            for layer, cache in enumerate(kv_caches):  # layer by layer: reads in order
                chunk = src[layer]
                for block, count, offset, length, t in pieces:
                    t0 = t - span.start
                    if cpu_rows and length == block_size and src.is_contiguous():
                        # whole cpu-layout blocks are contiguous rows: fill them by a gather
                        index = _block_order(count, block_size, heads, src.shape[2], t0, device)
                        blocks = cpu_rows[layer][block * block_rows:(block + count) * block_rows]
                        torch.index_select(chunk.view(-1, d), 0, index, out=blocks)
                    elif count == 1:  # (the cheapest indexing: the common case)
                        part = chunk[:, t0:t0 + length]
                        self._blocks(cache)[:, block, offset:offset + length].copy_(part)
                    else:  # whole blocks (for flash, contiguous for K and for V: a memcpy)
                        part = chunk[:, t0:t0 + count * length].view(2, count, length, heads, d)
                        self._blocks(cache)[:, block:block + count].copy_(part)
        _sync(device)  # the chunk buffers are released after this returns
        return None


def _scatter(rows: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``rows[index] = source`` for tables of rows. On the CPU ``index_copy_``
    moves one element per step, so rows go as 16-byte elements where their size
    and alignment allow (a bit-exact move, 2-3x faster for 2-byte dtypes)."""
    size = rows.element_size()
    if all((t.shape[1] * size) % 16 == 0 and (t.storage_offset() * size) % 16 == 0
           for t in (rows, source)):
        rows, source = rows.view(torch.complex128), source.view(torch.complex128)
    rows.index_copy_(0, index, source)


def _as_list(block_ids: Sequence[int] | torch.Tensor) -> Sequence[int]:
    return block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids


def _pieces(start: int, end: int, block_ids: Sequence[int],
            block_size: int) -> list[tuple[int, int, int, int, int]]:
    """Tokens ``[start, end)`` in as few copies as the block table allows:
    ``(first block, blocks, first offset, tokens per block, first token)`` per copy,
    which covers either part of one block or whole blocks with consecutive ids."""
    pieces = []
    t = start
    while t < end:
        i, offset = divmod(t, block_size)
        block, count = int(block_ids[i]), 1
        length = min(block_size - offset, end - t)
        if length == block_size:
            while (t + (count + 1) * block_size <= end
                   and block_ids[i + count] == block + count):
                count += 1
        pieces.append((block, count, offset, length, t))
        t += count * length
    return pieces


@functools.lru_cache(maxsize=256)
def _block_order(blocks: int, block_size: int, heads: int, tokens: int, first: int,
                 device: torch.device) -> torch.Tensor:
    """For each row of ``blocks`` whole cpu-layout blocks (order ``[block, head,
    offset, kv]``), its row in a chunk buffer of ``tokens`` tokens (order ``[kv,
    token, head]``) whose token ``first`` is the first block's first."""
    t = torch.arange(first, first + blocks * block_size, device=device)
    t = t.view(blocks, 1, block_size, 1)
    head = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv = torch.arange(2, device=device).view(1, 1, 1, 2)
    return ((kv * tokens + t) * heads + head).flatten()
