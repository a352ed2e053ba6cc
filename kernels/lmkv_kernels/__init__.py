"""lmkv's copy kernels: between paged KV caches and lmkv's chunk buffers.

Installed as ``lmkv_kernels`` (never ``kernels``: Hugging Face ships a package
of that name). It imports torch and the standard library only (Triton, when
installed, on the first copy of CUDA caches), so an engine integration or a
connector plugin can use it without the rest of lmkv.

Layouts (``lmkv_kernels.layouts``): one cache tensor per layer, ``flash``
``[2, num_blocks, block_size, kv_heads, head_dim]``, ``flashinfer``
``[num_blocks, 2, block_size, kv_heads, head_dim]``, ``cpu``
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` or ``mla``
``[num_blocks, block_size, latent_dim]``. A chunk buffer is ``[layers, planes,
tokens, kv_heads, head_dim]``: K at plane 0 and V at 1, or for ``mla`` the
latent as ``[layers, 1, tokens, 1, latent_dim]``. Dtypes: any whose bits can be
moved as they are (bf16, fp16, fp32 and fp8 e4m3 are tested).

Semantics, the same for every implementation:

- ``block_ids`` is a request's block table (a list of ints or an integer
  tensor): the request's token ``t`` lives in block ``block_ids[t // block_size]``
  at offset ``t % block_size``. Partial blocks and chunks that straddle blocks
  are fine; the table must cover the last token copied.
- ``chunks`` is a sequence of ``(start, buffer)``: ``buffer`` holds the request's
  tokens ``[start, start + buffer.shape[2])``. Buffers may be strided and may live
  on another device than the caches (pinned host memory, typically).
- ``layout``: the caches' layout where the caller knows it (vLLM's attention
  backend, a connector option); None reads it from the shape, which fails
  (one line) where flash and flashinfer cannot be told apart.
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

Dense per-layer KV (transformers' ``(K, V)`` pairs ``[batch, kv_heads, seq,
head_dim]``) is copied by ``gather_dense``/``scatter_dense``: one strided
``copy_`` per layer and plane, in torch on every device (a copy engine or
memcpy does it at full speed; no kernel would do better).

``implementation(device)`` picks the module that does the copies for caches
on ``device``: ``lmkv_kernels.triton_impl`` (Triton kernels) for CUDA caches
where Triton is installed, ``lmkv_kernels.host_impl`` (memcpy runs over
threads, in C) for caches in host memory where its extension was built, else
``lmkv_kernels.torch_ref`` (torch ops, any device: the reference every
implementation matches bit for bit). ``LMKV_KERNELS=torch`` (or
``kernels="torch"``) forces the reference, ``triton`` forces Triton and
``host`` the C copies (an error where they are not installed), ``auto`` is the
default. ``use_host_cpus(cpus)`` names the CPUs the C copies' threads run on.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, Literal, NamedTuple

import torch

from lmkv_kernels import host_impl, torch_ref
from lmkv_kernels.layouts import (
    LAYOUTS,
    Layout,
    PagedGeometry,
    check_layout,
    geometry,
    layout_of,
    planes_of,
    signature,
)

__all__ = ["KERNELS", "LAYOUTS", "Bound", "Kernels", "Layout", "PagedGeometry", "bind",
           "check_layout", "gather_blocks", "gather_dense", "geometry", "implementation",
           "layout_of", "planes_of", "scatter_blocks", "scatter_checked", "scatter_dense",
           "signature", "use_host_cpus"]

Kernels = Literal["auto", "triton", "host", "torch"]
KERNELS: tuple[Kernels, ...] = ("auto", "triton", "host", "torch")
#: The environment variable that chooses the implementation when a caller does not.
ENV = "LMKV_KERNELS"


def triton_available() -> bool:
    """Whether Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def implementation(device: torch.device | str, kernels: Kernels | None = None) -> ModuleType:
    """The module whose ``gather_blocks``/``scatter_blocks`` serve caches on ``device``.

    ``kernels``: ``auto`` (Triton for CUDA caches where it is installed, the C
    copies for host caches where they were built, else the reference),
    ``triton`` (Triton on any device: CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``), ``host`` (the C copies; caches on other devices, or
    in layouts they do not serve, go to the reference), ``torch`` (the
    reference); None reads ``LMKV_KERNELS`` (default ``auto``). ValueError (one
    line) for any other choice, or for ``triton`` or ``host`` where not installed.
    """
    choice = kernels if kernels is not None else (os.environ.get(ENV) or "auto")
    if choice not in KERNELS:
        where = "kernels" if kernels is not None else ENV
        raise ValueError(f"{where} = {choice!r}: expected one of {', '.join(KERNELS)}")
    if choice == "torch":
        return torch_ref
    if choice == "host":
        if not host_impl.available():
            raise ValueError("kernels = 'host' but lmkv_kernels' C copies were not built "
                             "(reinstall lmkv with a C compiler)")
        return host_impl
    on_host = (device if isinstance(device, torch.device) else torch.device(device)).type \
        == "cpu"
    if choice == "auto" and on_host:
        return host_impl if host_impl.available() else torch_ref
    if choice == "auto" and not triton_available():
        return torch_ref
    if not triton_available():
        raise ValueError("kernels = 'triton' but Triton is not installed (pip install triton)")
    from lmkv_kernels import triton_impl

    return triton_impl


def use_host_cpus(cpus: Iterable[int] | None) -> None:
    """The CPUs the C copies for host caches run on, one thread each (None: as
    many threads as torch's, on the caller's CPUs). An engine that binds each of
    its threads to one CPU names its set here. On the main thread the copies
    run on its OpenMP team instead (``host_impl.use_team``), its threads and
    CPUs as the engine set them."""
    host_impl.use_cpus(cpus)


class Bound(NamedTuple):
    """A set of caches whose copies were chosen and checked once (``bind``)."""

    implementation: ModuleType
    host: Any = None  # what the C copies need of them (host_impl.bind)


def bind(caches: Sequence[torch.Tensor], layout: Layout | None = None,
         kernels: Kernels | None = None) -> Bound:
    """The copies that serve ``caches`` (``implementation``, ``kernels`` or
    ``LMKV_KERNELS`` read now) and what they check of them once, for
    ``gather_blocks`` and ``scatter_blocks`` (``bound=``) of these same caches:
    a caller that copies to and from one set of caches many times binds it
    once, and binds again when ``layouts.signature`` of its caches changes."""
    impl = implementation(caches[0].device, kernels)
    return Bound(impl, host_impl.bind(caches, layout) if impl is host_impl else None)


def _copies(caches: Sequence[torch.Tensor], kernels: Kernels | None,
            bound: Bound | None) -> tuple[ModuleType, Any]:
    """The implementation for ``caches`` and what to give ``host_impl`` as its bound."""
    if bound is not None:
        return bound.implementation, bound.host
    return implementation(caches[0].device, kernels), host_impl.UNBOUND


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                  chunks: Sequence[tuple[int, torch.Tensor]], *, layout: Layout | None = None,
                  kernels: Kernels | None = None, heads_outer: bool = False,
                  bound: Bound | None = None) -> None:
    """Copy each chunk's tokens from the paged ``caches`` into its buffer.
    ``heads_outer``: the buffers are given in the order they are held in memory,
    ``[layers, kv_heads, tokens, planes, head_dim]`` (``torch_ref.planes_first``
    makes the usual view of one). ``bound``: ``bind(caches, layout, kernels)``
    (then ``kernels`` is not read again)."""
    if caches:
        impl, host = _copies(caches, kernels, bound)
        if impl is host_impl:
            impl.gather_blocks(caches, block_ids, chunks, layout, heads_outer, host)
        else:
            impl.gather_blocks(caches, block_ids, torch_ref.planes_first(chunks, heads_outer),
                               layout)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                   chunks: Sequence[tuple[int, torch.Tensor]], skip_tokens: int = 0, *,
                   layout: Layout | None = None, kernels: Kernels | None = None,
                   heads_outer: bool = False, bound: Bound | None = None) -> None:
    """Copy each chunk's buffer into the paged ``caches``, tokens from ``skip_tokens`` on.
    ``heads_outer`` and ``bound``: as for ``gather_blocks``."""
    if caches:
        impl, host = _copies(caches, kernels, bound)
        if impl is host_impl:
            impl.scatter_blocks(caches, block_ids, chunks, skip_tokens, layout, heads_outer,
                                host)
        else:
            impl.scatter_blocks(caches, block_ids, torch_ref.planes_first(chunks, heads_outer),
                                skip_tokens, layout)


def scatter_checked(caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                    chunks: Sequence[tuple[int, int, torch.Tensor, int]], skip_tokens: int = 0,
                    *, layout: Layout | None = None, kernels: Kernels | None = None,
                    bound: Bound | None = None) -> list[bool] | None:
    """``scatter_blocks`` of whole chunk buffers held heads outer, each one's bytes
    checked against an xxh3-64 as they are copied: ``(start, stop, buffer,
    checksum)`` copies the buffer's tokens up to the request's ``stop``. Per
    chunk, whether its bytes matched (one that did not may have been copied in
    part); None, nothing copied, where no implementation here checks as it
    copies (``host_impl.scatter_checked``: the C copies built with libxxhash,
    contiguous buffers in host memory): copy with ``scatter_blocks`` and check
    the checksum apart then."""
    if not caches:
        return None
    impl, host = _copies(caches, kernels, bound)
    if impl is not host_impl:
        return None
    return host_impl.scatter_checked(caches, block_ids, chunks, skip_tokens, layout, host)


def gather_dense(kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 chunks: Sequence[tuple[int, torch.Tensor]], batch_index: int = 0) -> None:
    """Copy each chunk's tokens of sequence ``batch_index`` from per-layer ``(K, V)``
    tensors ``[batch, kv_heads, seq, head_dim]`` into its buffer."""
    torch_ref.gather_dense(kv, chunks, batch_index)


def scatter_dense(kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  chunks: Sequence[tuple[int, torch.Tensor]], batch_index: int = 0) -> None:
    """Copy each chunk's buffer into sequence ``batch_index`` of per-layer ``(K, V)``."""
    torch_ref.scatter_dense(kv, chunks, batch_index)
