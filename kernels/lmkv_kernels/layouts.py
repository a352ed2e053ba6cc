"""The paged KV cache layouts lmkv copies from and to, and how to tell them apart.

This is the one place that knows them: the kernels address blocks through it,
and the paged connector reads a cache's layout and geometry from it (the vLLM
worker asks the connector, never the shapes). One tensor per layer:

- ``flash``: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention
  and most GPU backends; K at index 0, V at 1);
- ``cpu``: ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (vLLM's CPU
  backend; K in the first ``head_dim`` elements of each row, V in the rest).

The two differ in rank, so a cache's layout is read from its shape alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["flash", "cpu"]
LAYOUTS: tuple[Layout, ...] = ("flash", "cpu")

_FORMS = {"flash": "[2, num_blocks, block_size, kv_heads, head_dim]",
          "cpu": "[num_blocks, kv_heads, block_size, 2 * head_dim]"}


@dataclass(frozen=True)
class PagedGeometry:
    """What one layer's paged cache holds, whatever its layout."""

    layout: Layout
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The cache shape this geometry has in its layout."""
        return shape_of(self.layout, self.num_blocks, self.block_size, self.kv_heads,
                        self.head_dim)

    @property
    def form(self) -> str:
        """The layout's shape in words, for error messages."""
        return _FORMS[self.layout]


def shape_of(layout: Layout, num_blocks: int, block_size: int, kv_heads: int,
             head_dim: int) -> tuple[int, ...]:
    if layout == "flash":
        return (2, num_blocks, block_size, kv_heads, head_dim)
    return (num_blocks, kv_heads, block_size, 2 * head_dim)


def geometry(cache: torch.Tensor) -> PagedGeometry:
    """The layout and sizes of one layer's paged cache; ValueError (one line) when
    its shape is neither layout's."""
    shape = tuple(cache.shape)
    if len(shape) == 5 and shape[0] == 2:
        return PagedGeometry("flash", shape[1], shape[2], shape[3], shape[4])
    if len(shape) == 4 and shape[3] % 2 == 0:
        return PagedGeometry("cpu", shape[0], shape[2], shape[1], shape[3] // 2)
    raise ValueError(f"paged KV cache of shape {shape}: expected the flash layout "
                     f"{_FORMS['flash']} or the cpu layout {_FORMS['cpu']}")


def layout_of(cache: torch.Tensor) -> Layout:
    """``cache``'s layout (see ``geometry``)."""
    return geometry(cache).layout


def as_blocks(cache: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``cache`` viewed as ``[2, num_blocks, block_size, kv_heads, head_dim]``, the
    chunk buffer's order, so one slice addresses a run of blocks in either layout."""
    if layout == "flash":
        return cache
    num_blocks, heads, block_size, _ = cache.shape
    return cache.view(num_blocks, heads, block_size, 2, -1).permute(3, 0, 2, 1, 4)
