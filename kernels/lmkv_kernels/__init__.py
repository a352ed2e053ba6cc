"""lmkv's copy kernels: between paged KV caches and lmkv's chunk buffers.

Installed as ``lmkv_kernels`` (never ``kernels``: Hugging Face ships a package
of that name). It imports torch and the standard library only, so an engine
integration or a connector plugin can use it without the rest of lmkv.

Layouts (``lmkv_kernels.layouts``): one cache tensor per layer, ``flash``
``[2, num_blocks, block_size, kv_heads, head_dim]`` or ``cpu``
``[num_blocks, kv_heads, block_size, 2 * head_dim]``, told apart by rank.
A chunk buffer is ``[layers, 2, tokens, kv_heads, head_dim]`` (K at 0, V at 1).

Semantics, the same for every implementation:

- ``block_ids`` is a request's block table (a list of ints or an integer
  tensor): the request's token ``t`` lives in block ``block_ids[t // block_size]``
  at offset ``t % block_size``. Partial blocks and chunks that straddle blocks
  are fine; the table must cover the last token copied.
- ``chunks`` is a sequence of ``(start, buffer)``: ``buffer`` holds the request's
  tokens ``[start, start + buffer.shape[2])``. Buffers may be strided and may live
  on another device than the caches (pinned host memory, typically).
- ``gather_blocks(caches, block_ids, chunks)`` copies each chunk's tokens from
  the caches into its buffer (the store path).
- ``scatter_blocks(caches, block_ids, chunks, skip_tokens=0)`` copies each
  buffer into the caches, leaving the request's first ``skip_tokens`` tokens,
  the rest of a partly written block and every block outside the table as
  they are (the load path).
- Copies are bit-exact and need all caches to share one layout, shape, dtype
  and device, and buffers of the caches' dtype, ``kv_heads`` and ``head_dim``;
  shapes are not checked here (the paged connector checks them, once a call).
- Copies are issued on the caches' device (its current stream on a GPU), and
  those to or from a buffer on another device may still be in flight on
  return: synchronize that stream before reading a gathered buffer or
  reusing a scattered one.

``implementation(device)`` picks the module that does the copies for caches
on ``device``; today that is always ``lmkv_kernels.torch_ref`` (torch ops, any
device, the reference). A Triton module providing the same two functions can
be chosen there for CUDA caches without changing any caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from lmkv_kernels import torch_ref
from lmkv_kernels.layouts import LAYOUTS, Layout, PagedGeometry, geometry, layout_of

__all__ = ["LAYOUTS", "Layout", "PagedGeometry", "gather_blocks", "geometry",
           "implementation", "layout_of", "scatter_blocks"]


def implementation(device: torch.device) -> ModuleType:
    """The module whose ``gather_blocks``/``scatter_blocks`` serve caches on ``device``."""
    return torch_ref


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                  chunks: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Copy each chunk's tokens from the paged ``caches`` into its buffer."""
    if caches:
        implementation(caches[0].device).gather_blocks(caches, block_ids, chunks)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                   chunks: Sequence[tuple[int, torch.Tensor]], skip_tokens: int = 0) -> None:
    """Copy each chunk's buffer into the paged ``caches``, tokens from ``skip_tokens`` on."""
    if caches:
        implementation(caches[0].device).scatter_blocks(caches, block_ids, chunks,
                                                        skip_tokens)
