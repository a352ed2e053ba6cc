"""The paged KV cache layouts lmkv copies from and to, and how to tell them apart.

This is the one place that knows them: the kernels address blocks through it,
and the paged connector reads a cache's layout and geometry from it (the vLLM
worker asks the connector, never the shapes). One tensor per layer:

- ``flash``: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention
  and most GPU backends; K at index 0, V at 1);
- ``flashinfer``: ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (FlashInfer:
  a block's K and V side by side);
- ``cpu``: ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (vLLM's CPU
  backend; K in the first ``head_dim`` elements of each row, V in the rest);
- ``mla``: ``[num_blocks, block_size, latent_dim]`` (multi-head latent attention,
  DeepSeek: one latent vector per token instead of K and V, the same on every
  tensor-parallel rank), or ``[num_blocks, 1, block_size, latent_dim]`` (vLLM's
  logical ``[B, H, N, C]`` page with its one head slot: named only, as the
  shape is also the cpu layout's with one head).

Any strides are fine: vLLM 0.2x+ hands every backend's cache over as the
logical ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (the ``cpu``
layout's shape) in the backend's physical order (a permuted view), which the
copies follow.

A layout's chunk buffer is ``[layers, planes, tokens, kv_heads, head_dim]``:
``planes`` is 2 (K, V) for the first three and 1 for ``mla``, whose buffer is
``[layers, 1, tokens, 1, latent_dim]`` (so ``kv_heads`` is 1 and ``head_dim``
the latent's size in its geometry).

``flash`` and ``flashinfer`` have the same rank: a shape with 2 in both of its
first two dimensions is either. Callers that know the layout (the attention
backend's name, a connector option) pass it; the shape alone decides only
where it is unambiguous, and an ambiguous shape is a one-line ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["flash", "flashinfer", "cpu", "mla"]
LAYOUTS: tuple[Layout, ...] = ("flash", "flashinfer", "cpu", "mla")

_FORMS = {"flash": "[2, num_blocks, block_size, kv_heads, head_dim]",
          "flashinfer": "[num_blocks, 2, block_size, kv_heads, head_dim]",
          "cpu": "[num_blocks, kv_heads, block_size, 2 * head_dim]",
          "mla": "[num_blocks, block_size, latent_dim]"}
_ALL_FORMS = "; ".join(f"{name} {form}" for name, form in _FORMS.items())


@dataclass(frozen=True)
class PagedGeometry:
    """What one layer's paged cache holds, whatever its layout (``mla``: one
    head of ``head_dim`` = the latent's size, one plane)."""

    layout: Layout
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int

    @property
    def planes(self) -> int:
        """Vectors per token and head: 2 (K and V), 1 for ``mla`` (the latent)."""
        return planes_of(self.layout)

    @property
    def shape(self) -> tuple[int, ...]:
        """The cache shape this geometry has in its layout (``mla``: the rank-3 form)."""
        return shape_of(self.layout, self.num_blocks, self.block_size, self.kv_heads,
                        self.head_dim)

    @property
    def form(self) -> str:
        """The layout's shape in words, for error messages."""
        return _FORMS[self.layout]


def planes_of(layout: Layout) -> int:
    """2 (K and V) for every layout but ``mla`` (1: the latent)."""
    return 1 if layout == "mla" else 2


def shape_of(layout: Layout, num_blocks: int, block_size: int, kv_heads: int,
             head_dim: int) -> tuple[int, ...]:
    if layout == "flash":
        return (2, num_blocks, block_size, kv_heads, head_dim)
    if layout == "flashinfer":
        return (num_blocks, 2, block_size, kv_heads, head_dim)
    if layout == "mla":
        return (num_blocks, block_size, head_dim)
    return (num_blocks, kv_heads, block_size, 2 * head_dim)


def check_layout(layout: str) -> Layout:
    """``layout`` if lmkv knows it, else a one-line ValueError naming the known ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"paged KV cache layout {layout!r}: expected one of "
                         f"{', '.join(LAYOUTS)}")
    return layout


def geometry(cache: torch.Tensor, layout: Layout | None = None) -> PagedGeometry:
    """The layout and sizes of one layer's paged cache. ``layout``: the layout the
    caller knows the cache has (checked against the shape); None reads it from
    the shape. ValueError (one line) when the shape is no layout's, not
    ``layout``'s, or (without ``layout``) could be either flash or flashinfer."""
    shape = tuple(cache.shape)
    if layout is None:
        layout = _detect(shape)
    elif check_layout(layout) and not _fits(layout, shape):
        raise ValueError(f"paged KV cache of shape {shape}: the {layout} layout is "
                         f"{_FORMS[layout]}")
    if layout == "flash":
        return PagedGeometry("flash", shape[1], shape[2], shape[3], shape[4])
    if layout == "flashinfer":
        return PagedGeometry("flashinfer", shape[0], shape[2], shape[3], shape[4])
    if layout == "mla":
        return PagedGeometry("mla", shape[0], shape[-2], 1, shape[-1])
    return PagedGeometry("cpu", shape[0], shape[2], shape[1], shape[3] // 2)


def _fits(layout: Layout, shape: tuple[int, ...]) -> bool:
    if layout == "flash":
        return len(shape) == 5 and shape[0] == 2
    if layout == "flashinfer":
        return len(shape) == 5 and shape[1] == 2
    if layout == "mla":
        return len(shape) == 3 or (len(shape) == 4 and shape[1] == 1)
    return len(shape) == 4 and shape[3] % 2 == 0


def _detect(shape: tuple[int, ...]) -> Layout:
    if len(shape) == 3:
        return "mla"  # (a rank-4 mla cache is named: by shape it is a cpu one)
    fits = [layout for layout in LAYOUTS if layout != "mla" and _fits(layout, shape)]
    if len(fits) == 1:
        return fits[0]
    if fits:  # [2, 2, ...]: flash with 2 blocks or flashinfer with 2 blocks
        raise ValueError(f"paged KV cache of shape {shape} could be the flash or the "
                         "flashinfer layout: name its layout")
    raise ValueError(f"paged KV cache of shape {shape}: expected a layout of {_ALL_FORMS}")


def layout_of(cache: torch.Tensor) -> Layout:
    """``cache``'s layout read from its shape (see ``geometry``)."""
    return geometry(cache).layout


def as_blocks(cache: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``cache`` viewed as ``[planes, num_blocks, block_size, kv_heads, head_dim]``,
    the chunk buffer's order, so one slice addresses a run of blocks in any layout."""
    if layout == "flash":
        return cache
    if layout == "flashinfer":
        return cache.transpose(0, 1)
    if layout == "mla":
        return cache[None, :, :, None] if cache.dim() == 3 else cache[None].transpose(2, 3)
    num_blocks, heads, block_size, _ = cache.shape
    return cache.view(num_blocks, heads, block_size, 2, -1).permute(3, 0, 2, 1, 4)


def signature(caches: Sequence[torch.Tensor]) -> tuple:
    """What identifies a set of caches as a copy sees them: each one's address,
    shape, strides, dtype and whether it is in host memory. A set whose tensors
    moved, changed shape or were replaced has another."""
    return tuple([(c.data_ptr(), c.shape, c.stride(), c.dtype, c.is_cpu) for c in caches])
