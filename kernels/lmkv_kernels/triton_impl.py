"""The Triton implementation of the paged copies (semantics in ``lmkv_kernels``;
``lmkv_kernels.torch_ref`` is the reference it matches bit for bit).

One kernel launch per call moves every token of every chunk and layer, in
either direction, for every layout: a layout is only the strides of its
``[planes, num_blocks, block_size, kv_heads, head_dim]`` view
(``layouts.as_blocks``), and elements move as integers: of their width (bf16
as int16, fp8 as int8), or several at once where rows, strides and addresses
allow (up to 8 bytes a load): bit-exact whatever the dtype. Layers and chunk buffers
are reached through tables of their addresses, so neither needs to be one
tensor. Per token the host computes where the token lives in the cache (its
block's offset plus its slot's) and in its chunk, and copies those tables to
the caches' device (from pinned memory, without blocking the host); launches
run with the caches' device current. A program copies ``BLOCK_T`` tokens of
one layer.

Chunk buffers on another device (pinned host memory) or strided go through a
contiguous buffer on the caches' device, then one transfer per chunk, as in
the reference. Named ``triton_impl`` so that it never shadows the ``triton``
package; imported only when chosen (``lmkv_kernels.implementation``), so
Triton stays optional. Runs on CUDA, and on CPU tensors under Triton's
interpreter: ``TRITON_INTERPRET=1`` must be in the environment when this
module is imported, as ``triton.jit`` reads it when it decorates the kernel
(``tests/kernels/test_kernels_triton.py`` sets it and reloads the module).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from lmkv_kernels.layouts import Layout, as_blocks, geometry

Chunks = Sequence[tuple[int, torch.Tensor]]
BlockIds = Sequence[int] | torch.Tensor

#: Words (one element or several) move as the signed integers of their width.
_TL_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
#: Words a program moves per plane, head and step, about: enough to keep loads
#: in flight, small enough for registers.
_TILE = 4096


@triton.jit
def _copy_kernel(cache_table, buf_table, cache_tok, buf_chunk, buf_tok, buf_len, n_tokens,
                 s_plane, s_head, s_dim,
                 HEADS: tl.constexpr, DIM: tl.constexpr, PLANES: tl.constexpr,
                 WORD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                 GATHER: tl.constexpr):
    """Copy ``BLOCK_T`` tokens of layer ``program_id(1)`` between the paged cache
    (word ``cache_tok[i] + plane * s_plane + head * s_head + dim * s_dim`` of
    the layer's cache) and their chunk buffers (contiguous ``[layers, planes,
    buf_len[i], HEADS, DIM]`` words, token ``buf_tok[i]`` of buffer
    ``buf_chunk[i]``); ``GATHER``: cache to buffer, else buffer to cache. A
    word is an integer of type ``WORD``: one element or several (``_words``)."""
    tile = tl.program_id(0)
    layer = tl.program_id(1)
    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tokens < n_tokens
    cache = tl.load(cache_table + layer).to(tl.pointer_type(WORD))
    cache_at = tl.load(cache_tok + tokens, mask=live, other=0)
    chunk = tl.load(buf_chunk + tokens, mask=live, other=0)
    length = tl.load(buf_len + tokens, mask=live, other=0).to(tl.int64)
    buf = tl.load(buf_table + chunk, mask=live, other=0).to(tl.pointer_type(WORD))
    plane_size = length * (HEADS * DIM)  # words of one plane of one layer in the chunk
    buf_at = (tl.load(buf_tok + tokens, mask=live, other=0).to(tl.int64) * (HEADS * DIM)
              + layer * PLANES * plane_size)
    for head in range(HEADS):
        for d0 in range(0, DIM, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = live[:, None] & (d < DIM)[None, :]
            for plane in tl.static_range(PLANES):
                c = (cache + (cache_at + plane * s_plane + head * s_head))[:, None] \
                    + (d * s_dim)[None, :]
                b = (buf + (buf_at + plane * plane_size + head * DIM))[:, None] + d[None, :]
                if GATHER:
                    tl.store(b, tl.load(c, mask=mask), mask=mask)
                else:
                    tl.store(c, tl.load(b, mask=mask), mask=mask)


#: The most bytes of chunk buffers staged on the caches' device at once, for
#: buffers the kernel cannot address (pinned host memory): a load of 32768
#: Llama-8B tokens is 4 GiB, which must not land outside the engine's memory
#: budget in one piece. Each batch is one launch.
STAGING_BYTES = 256 << 20


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                  layout: Layout | None = None) -> None:
    if not chunks:
        return
    device = caches[0].device
    for batch in _batches(chunks, device):
        outs = [buf if _direct(buf, device) else
                torch.empty(buf.shape, dtype=buf.dtype, device=device) for _, buf in batch]
        _launch(caches, block_ids, [(start, out) for (start, _), out in zip(batch, outs,
                                                                             strict=True)],
                0, layout, gather=True)
        for (_, buf), out in zip(batch, outs, strict=True):
            if out is not buf:  # (its memory is reused in stream order: after this copy)
                buf.copy_(out, non_blocking=True)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                   skip_tokens: int = 0, layout: Layout | None = None) -> None:
    device = caches[0].device
    wanted = [(start, buf) for start, buf in chunks if start + buf.shape[2] > skip_tokens]
    for batch in _batches(wanted, device):
        staged = [(start, buf if _direct(buf, device) else
                   buf.to(device, non_blocking=True).contiguous()) for start, buf in batch]
        _launch(caches, block_ids, staged, skip_tokens, layout, gather=False)


def _batches(chunks: Chunks, device: torch.device) -> list[list[tuple[int, torch.Tensor]]]:
    """``chunks`` in runs whose staged copies (the buffers not ``_direct``) take at
    most ``STAGING_BYTES``; one chunk per run at least."""
    out: list[list[tuple[int, torch.Tensor]]] = []
    size = 0
    for start, buf in chunks:
        need = 0 if _direct(buf, device) else buf.numel() * buf.element_size()
        if not out or (size + need > STAGING_BYTES and size):
            out.append([])
            size = 0
        out[-1].append((start, buf))
        size += need
    return out


def _direct(buf: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel can address ``buf`` itself (else it goes through a copy)."""
    return buf.device == device and buf.is_contiguous()


def _launch(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
            skip_tokens: int, layout: Layout | None, *, gather: bool) -> None:
    # Triton launches on the current CUDA device: the caches' (the calling thread's
    # current device may be another, on a multi-GPU host).
    with _on_device(caches[0].device):
        _launch_on(caches, block_ids, chunks, skip_tokens, layout, gather=gather)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index table on ``device``. To CUDA from pinned memory, without
    blocking: a copy from pageable memory would block the host until the transfer
    stream got there, that is until the forward it waits for is done. The pinned
    staging memory comes from torch's caching host allocator, which does not reuse
    it before the copy that reads it has run (an event on the current stream)."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def _launch_on(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
               skip_tokens: int, layout: Layout | None, *, gather: bool) -> None:
    g = geometry(caches[0], layout)
    device = caches[0].device
    views = [as_blocks(cache, g.layout) for cache in caches]
    strides = views[0].stride()
    if any(view.stride() != strides for view in views):
        # (never from vLLM: its layers share one allocation's layout)
        raise ValueError("paged KV caches with different strides; the Triton copies "
                         "need one layout for all layers (use the torch reference)")
    word, factor = _words(caches, [buf for _, buf in chunks], strides, g.head_dim)
    s_plane, s_block, s_slot, s_head, s_dim = (s // factor if i < 4 else s
                                               for i, s in enumerate(strides))
    dim = g.head_dim // factor
    cache_tok, buf_chunk, buf_tok, buf_len = _token_tables(block_ids, chunks, skip_tokens,
                                                           g.block_size, s_block, s_slot,
                                                           device)
    n_tokens = cache_tok.numel()
    if n_tokens == 0:
        return
    cache_table = _to_device(torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64),
                             device)
    buf_table = _to_device(torch.tensor([buf.data_ptr() for _, buf in chunks],
                                        dtype=torch.int64), device)
    block_d = min(triton.next_power_of_2(dim), _TILE)
    block_t = max(1, _TILE // block_d)  # (whatever n_tokens: one compiled kernel a shape)
    grid = (triton.cdiv(n_tokens, block_t), len(caches))
    _copy_kernel[grid](cache_table, buf_table, cache_tok, buf_chunk, buf_tok, buf_len,
                       n_tokens, s_plane, s_head, s_dim,
                       HEADS=g.kv_heads, DIM=dim, PLANES=g.planes, WORD=_TL_INT[word],
                       BLOCK_T=block_t, BLOCK_D=block_d, GATHER=gather)


def _words(caches: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
           strides: tuple[int, ...], head_dim: int) -> tuple[int, int]:
    """``(bytes a word, elements a word)``: the widest integer (up to 8 bytes)
    that a head's row, every stride but the last and every cache and buffer
    address are multiples of, where a row is contiguous; one element
    otherwise. Wider words move a bf16 row in a quarter of the loads and
    stores, bits unchanged."""
    size = caches[0].element_size()
    if strides[-1] != 1:
        return size, 1
    addresses = [t.data_ptr() for t in (*caches, *buffers)]
    for word in (8, 4, 2):
        if word <= size:
            break
        if ((head_dim * size) % word == 0 and all(s * size % word == 0 for s in strides[:-1])
                and all(a % word == 0 for a in addresses)):
            return word, word // size
    return size, 1


def _token_tables(block_ids: BlockIds, chunks: Chunks, skip_tokens: int, block_size: int,
                  s_block: int, s_slot: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token copied, in chunk order: its element offset in a layer's cache
    (plane 0, head 0, dim 0), its chunk's index, its index in that chunk and
    that chunk's length (tokens before ``skip_tokens`` left out)."""
    starts = torch.tensor([start for start, _ in chunks], dtype=torch.int64)
    lengths = torch.tensor([buf.shape[2] for _, buf in chunks], dtype=torch.int64)
    chunk = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    in_chunk = torch.arange(int(lengths.sum())) - first[chunk]
    token = starts[chunk] + in_chunk
    keep = token >= skip_tokens
    if not bool(keep.all()):
        chunk, in_chunk, token = chunk[keep], in_chunk[keep], token[keep]
    end = int(token.max()) + 1 if token.numel() else 0
    ids = block_ids[:-(-end // block_size)]
    ids = torch.as_tensor(ids if len(ids) else [], dtype=torch.int64)
    ids = ids.to("cpu", torch.int64)
    cache_tok = ids[token // block_size] * s_block + (token % block_size) * s_slot
    return (_to_device(cache_tok, device), _to_device(chunk.to(torch.int32), device),
            _to_device(in_chunk.to(torch.int32), device),
            _to_device(lengths[chunk].to(torch.int32), device))
