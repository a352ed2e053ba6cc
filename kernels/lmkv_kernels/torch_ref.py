"""The torch implementation of the paged copies: the reference every other
implementation must match bit for bit (semantics in ``lmkv_kernels``).

Copies are few and long: one per layer and chunk where rows can be gathered by
index, else one per run of consecutive block ids (``benchmarks/bench_paged.py``
measures them against a memcpy). It runs on any torch device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from lmkv_kernels.layouts import Layout, PagedGeometry, as_blocks, geometry

Chunks = Sequence[tuple[int, torch.Tensor]]
BlockIds = Sequence[int] | torch.Tensor

#: Dtypes torch's index copies lack (``index_copy_`` has no fp8 on the CPU):
#: copied as the unsigned integers of their width, bit for bit.
_BITWISE = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                  layout: Layout | None = None) -> None:
    if not chunks:
        return
    g = geometry(caches[0], layout)
    caches, chunks = _bitwise(caches, chunks)
    end = max(start + buf.shape[2] for start, buf in chunks)
    device, d, heads = caches[0].device, g.head_dim, g.kv_heads
    canonical = any(_head_runs(buf, g) is None for _, buf in chunks)
    contiguous = all(cache.is_contiguous() for cache in caches)
    # (heads-outer chunks need neither row tables nor an index)
    rows = _rows(caches, g) if contiguous and canonical else None
    if rows:
        token_rows, kv_head_rows = _gather_index(block_ids, end, caches[0], g)
    ids = _as_list(block_ids)
    for start, buf in chunks:
        stop = start + buf.shape[2]
        # gather on the cache's device, then one transfer to the buffer
        out = buf if buf.device == device else torch.empty_like(buf, device=device)
        runs = _head_runs(out, g)
        if runs is not None:  # cpu caches, heads-outer buffer (KVSpec.heads_outer)
            _heads_outer(caches, runs, start, start, stop, ids, g, contiguous,
                         into_caches=False)
        elif rows and out.is_contiguous():  # one gather per layer, whatever the table
            index = (token_rows[start:stop] + kv_head_rows).view(-1)
            for layer, cache_rows in enumerate(rows):
                torch.index_select(cache_rows, 0, index,
                                   out=out[layer].view(-1, cache_rows.shape[1]))
        else:
            pieces = _pieces(start, stop, ids, g.block_size)
            for layer, cache in enumerate(caches):  # layer by layer: reads in order
                blocks = as_blocks(cache, g.layout)
                for block, count, offset, length, t in pieces:
                    t0 = t - start
                    part = out[layer, :, t0:t0 + count * length]
                    part = part.view(g.planes, count, length, heads, d)
                    part.copy_(blocks[:, block:block + count, offset:offset + length])
        if out is not buf:
            buf.copy_(out, non_blocking=True)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                   skip_tokens: int = 0, layout: Layout | None = None) -> None:
    if not chunks:
        return
    g = geometry(caches[0], layout)
    caches, chunks = _bitwise(caches, chunks)
    end = max(start + buf.shape[2] for start, buf in chunks)
    device, d, heads, block_size = caches[0].device, g.head_dim, g.kv_heads, g.block_size
    ids = _as_list(block_ids)
    # (heads-outer chunks plan their own copies: no pieces here)
    loads = [(start, buf, [] if _head_runs(buf, g) is not None else
              _pieces(max(start, skip_tokens), start + buf.shape[2], ids, block_size))
             for start, buf in chunks if start + buf.shape[2] > skip_tokens]
    # (heads-outer chunks need only to know whether the caches are contiguous)
    contiguous = all(cache.is_contiguous() for cache in caches)
    rows = (_rows(caches, g) if contiguous and any(pieces for _, _, pieces in loads)
            else None)
    # small or scattered blocks (over two copies a layer): one scatter per layer
    scatter = bool(rows) and any(len(pieces) > 2 for _, _, pieces in loads)
    if scatter:
        token_rows, kv_head_rows = _gather_index(block_ids, end, caches[0], g)
    cpu_rows = rows if g.layout == "cpu" else None
    block_rows = 2 * heads * block_size
    for start, buf, pieces in loads:
        src = buf.to(device, non_blocking=True)  # one transfer
        runs = _head_runs(src, g)
        if runs is not None:  # cpu caches, heads-outer buffer (KVSpec.heads_outer)
            _heads_outer(caches, runs, start, max(start, skip_tokens), start + buf.shape[2],
                         ids, g, contiguous, into_caches=True)
            continue
        if scatter and rows and len(pieces) > 2:
            first = max(start, skip_tokens)
            index = (token_rows[first:start + buf.shape[2]] + kv_head_rows).view(-1)
            part = src[:, :, first - start:]
            for layer, cache_rows in enumerate(rows):
                _scatter(cache_rows, index, part[layer].reshape(-1, cache_rows.shape[1]))
            continue
        for layer, cache in enumerate(caches):  # layer by layer: reads in order
            chunk = src[layer]
            for block, count, offset, length, t in pieces:
                t0 = t - start
                if cpu_rows and length == block_size and src.is_contiguous():
                    # whole cpu-layout blocks are contiguous rows: fill them by a gather
                    index = _block_order(count, block_size, heads, src.shape[2], t0, device)
                    dst = cpu_rows[layer][block * block_rows:(block + count) * block_rows]
                    torch.index_select(chunk.view(-1, d), 0, index, out=dst)
                elif count == 1:  # (the cheapest indexing: the common case)
                    part = chunk[:, t0:t0 + length]
                    as_blocks(cache, g.layout)[:, block, offset:offset + length].copy_(part)
                else:  # whole blocks (for flash, contiguous for K and for V: a memcpy)
                    part = chunk[:, t0:t0 + count * length]
                    part = part.view(g.planes, count, length, heads, d)
                    as_blocks(cache, g.layout)[:, block:block + count].copy_(part)


def _bitwise(caches: Sequence[torch.Tensor], chunks: Chunks
             ) -> tuple[Sequence[torch.Tensor], Chunks]:
    """Caches and buffers as integers of their width where torch cannot index
    their dtype (views: the same memory)."""
    as_int = _BITWISE.get(caches[0].dtype)
    if as_int is None:
        return caches, chunks
    return ([cache.view(as_int) for cache in caches],
            [(start, buf.view(as_int)) for start, buf in chunks])


def _heads_outer(caches: Sequence[torch.Tensor], runs: torch.Tensor, start: int, first: int,
                 stop: int, ids: Sequence[int], g: PagedGeometry, contiguous: bool, *,
                 into_caches: bool) -> None:
    """Tokens ``[first, stop)`` between cpu caches and a heads-outer chunk holding
    tokens from ``start`` (``runs``: ``[layers, heads, tokens, 2 * dim]``, see
    ``_head_runs``). A head's tokens of a whole block are one row of ``block *
    2 * dim`` elements on both sides: whole blocks go as rows by index, one
    gather or scatter per layer, whatever the block table (consecutive or
    scattered ids alike). A chunk whose tokens lie in at most two runs of
    consecutive blocks (a fresh request's table, large blocks) goes by a copy
    per run instead: long strided copies beat the element-wise scatter. The
    partial blocks at either end, chunks that do not start on a block, and
    caches that are not contiguous go by a copy per run of blocks too."""
    bs, heads, width = g.block_size, g.kv_heads, 2 * g.head_dim
    a = b = stop
    pieces = _pieces(first, stop, ids, bs)
    if len(pieces) > 2 and contiguous and start % bs == 0:
        a = min(-(-first // bs) * bs, stop)
        b = max(a, stop // bs * bs)
        pieces = _pieces(first, a, ids, bs) + _pieces(b, stop, ids, bs)
    if b > a:  # whole blocks, rows ``block * heads + head`` of each layer's cache
        layers = runs.unbind(0)
        n, row = (b - a) // bs, bs * width
        device = caches[0].device
        blocks = torch.as_tensor(ids[a // bs:b // bs], dtype=torch.int64, device=device)
        index = blocks[None, :] * heads + torch.arange(heads, device=device)[:, None]
        for cache, head_rows in zip(caches, layers, strict=True):
            part = head_rows.narrow(1, a - start, n * bs).view(heads, n, row)
            cache_rows = cache.view(-1, row)
            # one call for all heads where the chunk's heads are back to back
            pairs = ([(index.view(-1), part.view(heads * n, row))] if part.stride(0) == n * row
                     else list(zip(index, part, strict=True)))
            for rows_index, chunk_rows in pairs:
                if into_caches:
                    _scatter(cache_rows, rows_index, chunk_rows)
                else:
                    torch.index_select(cache_rows, 0, rows_index, out=chunk_rows)
    for block, count, offset, length, t in pieces:
        # every layer's part at once (views), then one call copies them all
        part = runs.narrow(2, t - start, count * length)
        if count > 1:
            parts = part.view(len(caches), heads, count, length, width).transpose(1, 2)
            blocks_of = [cache.narrow(0, block, count) for cache in caches]
        else:
            parts = part
            blocks_of = [cache[block].narrow(1, offset, length) for cache in caches]
        if into_caches:
            _copy_all(blocks_of, parts.unbind(0))
        else:
            _copy_all(list(parts.unbind(0)), blocks_of)


def _copy_all(dst: list[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one call where torch has it (the loop runs
    in C++: a layer's copy then costs no Python)."""
    if _FOREACH_COPY is not None:
        _FOREACH_COPY(dst, list(src))
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def planes_first(chunks: Chunks, heads_outer: bool = True) -> Chunks:
    """Chunks whose buffers are given as held in memory, ``[layers, kv_heads,
    tokens, planes, head_dim]`` (``heads_outer``), as the usual ``[layers,
    planes, tokens, kv_heads, head_dim]`` views; others as they are."""
    if not heads_outer:
        return chunks
    return [(start, buf.permute(0, 3, 2, 1, 4)) for start, buf in chunks]


def _head_runs(buf: torch.Tensor, g: PagedGeometry) -> torch.Tensor | None:
    """For cpu caches, a chunk buffer held heads outer (``[layers, heads, tokens,
    2, dim]`` in memory, viewed ``[layers, 2, tokens, heads, dim]``) as ``[layers,
    heads, tokens, 2 * dim]``: a head's tokens are then rows of a cpu block, and a
    run of blocks copies as one strided copy of whole rows. None for any other
    layout or buffer order."""
    if g.layout != "cpu" or g.planes != 2:
        return None
    runs = buf.permute(0, 3, 2, 1, 4)
    d = g.head_dim
    if runs.stride(4) != 1 or runs.stride(3) != d or runs.stride(2) != 2 * d:
        return None
    return runs.flatten(3)


def _rows(caches: Sequence[torch.Tensor], g: PagedGeometry) -> list[torch.Tensor] | None:
    """Each cache as a table of rows, or None unless all are contiguous. cpu
    layout: rows of ``head_dim`` elements, K or V of one head and token (row
    ``((block * kv_heads + head) * block_size + offset) * 2 + kv``); flash: rows
    of ``kv_heads * head_dim``, K or V of one token (row ``(kv * num_blocks +
    block) * block_size + offset``); flashinfer: the same rows (row ``(block * 2
    + kv) * block_size + offset``); mla: rows of the latent, one per token (row
    ``block * block_size + offset``). Copying whole rows by index
    (``index_select``) runs at about memcpy speed, where a strided ``copy_``
    runs short inner loops on the cpu layout (1.3-2x slower) and takes a copy
    per block of a fragmented block table."""
    if not all(cache.is_contiguous() for cache in caches):
        return None
    row = g.head_dim * (g.kv_heads if g.layout in ("flash", "flashinfer") else 1)
    return [cache.view(-1, row) for cache in caches]


def _gather_index(block_ids: BlockIds, end: int, cache: torch.Tensor,
                  g: PagedGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_rows [end, 1], kv_head_rows [planes, 1, kv_heads or 1])``: their sum
    is the cache row (see ``_rows``) of each row of a chunk buffer in that order."""
    block_size, heads = g.block_size, g.kv_heads
    n_blocks = -(-end // block_size)
    ids = torch.as_tensor(block_ids[:n_blocks]).to(cache.device, torch.int64)[:, None]
    offsets = torch.arange(block_size, device=cache.device)
    kv = torch.arange(g.planes, device=cache.device)[:, None, None]
    if g.layout == "flash":
        token_rows = ids * block_size + offsets
        kv_head_rows = kv * (g.num_blocks * block_size)
    elif g.layout == "flashinfer":
        token_rows = ids * (2 * block_size) + offsets
        kv_head_rows = kv * block_size
    elif g.layout == "mla":
        token_rows = ids * block_size + offsets
        kv_head_rows = kv
    else:
        token_rows = (ids * (heads * block_size) + offsets) * 2
        kv_head_rows = kv + torch.arange(heads, device=cache.device) * (2 * block_size)
    return token_rows.view(-1, 1)[:end], kv_head_rows


def _scatter(rows: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``rows[index] = source`` for tables of rows. On the CPU ``index_copy_``
    moves one element per step, so rows go as 16-byte elements where their size
    and alignment allow (a bit-exact move, 2-3x faster for 2-byte dtypes)."""
    size = rows.element_size()
    if all((t.shape[1] * size) % 16 == 0 and (t.storage_offset() * size) % 16 == 0
           for t in (rows, source)):
        rows, source = rows.view(torch.complex128), source.view(torch.complex128)
    rows.index_copy_(0, index, source)


def _as_list(block_ids: BlockIds) -> Sequence[int]:
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


# -- dense per-layer KV (transformers): one strided copy per layer and plane ---------------------

def gather_dense(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], chunks: Chunks,
                 batch_index: int = 0) -> None:
    for start, buf in chunks:
        stop = start + buf.shape[2]
        for layer, pair in enumerate(kv):
            for plane, t in enumerate(pair):
                buf[layer, plane].copy_(t[batch_index, :, start:stop].transpose(0, 1),
                                        non_blocking=True)


def scatter_dense(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], chunks: Chunks,
                  batch_index: int = 0) -> None:
    for start, buf in chunks:
        stop = start + buf.shape[2]
        for layer, pair in enumerate(kv):
            for plane, t in enumerate(pair):
                t[batch_index, :, start:stop].copy_(buf[layer, plane].transpose(0, 1),
                                                    non_blocking=True)
