"""vLLM-style paged KV caches, copied to and from lmkv's chunk buffers
``[layers, planes, tokens, kv_heads, head_dim]`` by the ``lmkv_kernels`` copies
(for ``cpu`` caches held heads outer, ``[layers, kv_heads, tokens, 2, head_dim]``:
``KVSpec.heads_outer``, the caches' own order, so a block copies as whole rows).

The connector checks what it is given (once a call, one line when wrong). The
caches' layout is, in this order: the connector's ``layout`` option, the
layout the integration knows (``ConnectorContext.kv_layout``: vLLM's attention
backend), else the caches' shapes (``lmkv_kernels.layouts``). Every layout
lmkv_kernels knows is served here: a new layout is a kernel and a reference
there, never a new connector.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch

import lmkv_kernels
from lmkv.base import affinity
from lmkv.contracts.connector import ChunkSpan, ConnectorContext, GPUConnector, KVSpec
from lmkv.contracts.plugin import OptionsArg, PluginOptions
from lmkv.memory.transfer_stream import stream_for
from lmkv_backends.connectors.common import check
from lmkv_kernels import host_impl
from lmkv_kernels.layouts import PagedGeometry, shape_of


class PagedOptions(PluginOptions):
    layout: Literal["auto", "flash", "flashinfer", "cpu", "mla"] = "auto"
    """The caches' layout; ``auto``: the one the integration names (vLLM's
    attention backend), else the one their shape shows (an error where flash
    and flashinfer cannot be told apart)."""
    kernels: Literal["auto", "triton", "host", "torch"] = "auto"
    """Which copies run (``lmkv_kernels.implementation``): ``auto`` is Triton for
    CUDA caches where it is installed, the C copies (memcpy runs over threads)
    for caches in host memory where they were built, else the torch reference;
    ``torch`` forces the reference; ``triton`` forces Triton; ``host`` forces
    the C copies."""


def _spec(g: PagedGeometry, num_layers: int, dtype: torch.dtype) -> KVSpec:
    # cpu caches keep a head's K and V of a token side by side, block after block
    # ([blocks, heads, block, 2 * dim]): chunks in that order ([layers, heads,
    # tokens, 2, dim]) copy a whole block of a head in one run.
    return KVSpec(num_layers, g.kv_heads, g.head_dim, dtype, kv_planes=g.planes,
                  heads_outer=g.layout == "cpu")


def _own_copies(cls: type[GPUConnector]) -> bool:
    """Whether ``cls`` copies with this connector's own ``to_chunks``/``from_chunks``:
    only those know heads-outer chunks; a subclass with copies of its own moves
    the canonical order it was written for."""
    return cls.to_chunks is PagedConnector.to_chunks \
        and cls.from_chunks is PagedConnector.from_chunks


class PagedConnector(GPUConnector):
    """vLLM-style paged KV caches addressed by block ids.

    Keyword arguments: ``kv_caches`` (one tensor per layer, all in one layout:
    ``flash`` ``[2, num_blocks, block_size, kv_heads, head_dim]``, ``flashinfer``
    ``[num_blocks, 2, block_size, kv_heads, head_dim]``, ``cpu`` ``[num_blocks,
    kv_heads, block_size, 2 * head_dim]`` or ``mla`` ``[num_blocks, block_size,
    latent_dim]``) and ``block_ids`` (the request's block table: token ``t``
    lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``).
    Partial blocks and chunks that straddle blocks are fine.
    """

    name = "paged"
    api_version = "2.2"
    kv_kind = "paged"
    writes_in_place = True
    Options = PagedOptions

    # The base class takes any keywords: each connector names those of its engine's KV.
    @classmethod
    def spec_from(cls, *, kv_caches: Sequence[torch.Tensor],  # type: ignore[override]
                  kv_layout: str | None = None, **_: Any) -> KVSpec:
        """The spec of vLLM's paged caches in ``kv_layout`` (None: read from their
        shapes). For ``cpu`` caches its chunks are ``heads_outer`` (``lht2d``)."""
        check(len(kv_caches) > 0, "no KV caches; expected one paged cache per layer")
        g = lmkv_kernels.geometry(kv_caches[0], kv_layout)  # type: ignore[arg-type]
        spec = _spec(g, len(kv_caches), kv_caches[0].dtype)
        return spec if _own_copies(cls) else replace(spec, heads_outer=False)

    def __init__(self, options: OptionsArg, context: ConnectorContext) -> None:
        super().__init__(options, context)
        if context.spec.heads_outer and _own_copies(type(self)):
            self.chunk_layout = context.spec.chunk_layout
        options = self.options
        assert isinstance(options, PagedOptions)
        layout = options.layout if options.layout != "auto" else context.kv_layout
        self.layout: lmkv_kernels.Layout | None = (
            None if layout is None else lmkv_kernels.check_layout(layout))
        self.kernels: lmkv_kernels.Kernels | None = (
            None if options.kernels == "auto" else options.kernels)
        #: The sets of caches that passed ``_check_caches``, by ``signature``: their
        #: geometry and copies (LMKV_KERNELS is read when a set is first copied)
        self._checked: dict[tuple, tuple[PagedGeometry, lmkv_kernels.Bound]] = {}
        #: The last set checked: its tensors (weakly), their addresses, their
        #: storages then (held: ``_same_as_last``), its check.
        self._last: tuple[tuple[weakref.ref, ...], tuple[int, ...], tuple[Any, ...],
                          tuple[PagedGeometry, lmkv_kernels.Bound]] | None = None
        # the host copies' threads: on the engine's CPUs where it binds its threads
        cpus = affinity.shared()
        if cpus is not None:
            lmkv_kernels.use_host_cpus(cpus)

    def _validate(self, kv_caches: Sequence[torch.Tensor], block_ids: Any,
                  end: int) -> tuple[PagedGeometry, lmkv_kernels.Bound]:
        """Check the caches against the spec and the block table against ``end``;
        the caches' geometry and their copies (bound once per set of caches)."""
        checked = self._same_as_last(kv_caches)
        if checked is None:
            checked = self._bound(kv_caches)
        g = checked[0]
        # (each message is made only where its check fails: this runs per request)
        if len(block_ids) * g.block_size < end:
            check(False, f"{len(block_ids)} blocks of {g.block_size} tokens cannot hold "
                  f"{end} tokens")
        used = block_ids[:-(-end // g.block_size)]
        if len(used):  # a negative or too large id would wrap into another request's block
            low, high = (int(used.min()), int(used.max())) if isinstance(used, torch.Tensor) \
                else (min(used), max(used))
            if low < 0 or high >= g.num_blocks:
                check(False, f"block ids {low}..{high} out of range: the caches hold "
                      f"{g.num_blocks} blocks")
        return checked

    def _same_as_last(self, kv_caches: Sequence[torch.Tensor]
                      ) -> tuple[PagedGeometry, lmkv_kernels.Bound] | None:
        """The last set's check where ``kv_caches`` are its very tensors (held
        weakly: none of them was freed and replaced), each at the same address.
        An engine passes one set per request: this spares the full ``signature``.
        The storage each one had when it was bound is held with the check: no
        other memory can take its address while it does, so a tensor still at
        that address is still in that storage (one given other storage in place
        moves), and what was bound then is memory the copies may write."""
        last = self._last
        if last is None:
            return None
        refs, addresses, _, checked = last
        try:
            if len(kv_caches) != len(refs):
                return None
            for ref, cache, address in zip(refs, kv_caches, addresses, strict=True):
                if ref() is not cache or cache.data_ptr() != address:
                    return None
        except (AttributeError, TypeError):  # not tensors: the full check says what
            return None
        return checked

    def _bound(self, kv_caches: Sequence[torch.Tensor]
               ) -> tuple[PagedGeometry, lmkv_kernels.Bound]:
        """``kv_caches`` checked and bound (once per ``signature``), kept as the last set."""
        try:
            signature: tuple | None = lmkv_kernels.signature(kv_caches)
        except (AttributeError, TypeError):  # not tensors: _check_caches says what is wrong
            signature = None
        checked = self._checked.get(signature) if signature is not None else None
        if checked is None:
            g = self._check_caches(kv_caches)
            checked = (g, lmkv_kernels.bind(kv_caches, g.layout, self.kernels))
            if signature is not None:
                if len(self._checked) >= 256:  # (a direct load binds a set per piece of layers)
                    self._checked.clear()
                self._checked[signature] = checked
        if signature is not None:
            self._last = (tuple(weakref.ref(c) for c in kv_caches),
                          tuple(c.data_ptr() for c in kv_caches),
                          tuple(c.untyped_storage() for c in kv_caches), checked)
        return checked

    def _check_caches(self, kv_caches: Sequence[torch.Tensor]) -> PagedGeometry:
        spec = self.spec
        check(len(kv_caches) == spec.num_layers,
              f"{len(kv_caches)} KV caches; this engine stores {spec.num_layers} layers")
        first = kv_caches[0]
        g = lmkv_kernels.geometry(first, self.layout)
        shape = first.shape
        for cache in kv_caches:
            if cache.shape == shape and cache.dtype == spec.dtype:
                continue  # (the messages cost more than the checks on this hot path)
            check(cache.shape == shape, f"KV caches of shapes {tuple(shape)} and "
                  f"{tuple(cache.shape)}; all layers' must be one")
            check(cache.dtype == spec.dtype, f"KV dtype {cache.dtype}; expected {spec.dtype}")
        expected = shape_of(g.layout, g.num_blocks, g.block_size, spec.num_kv_heads,
                            spec.head_dim)
        check(g.kv_heads == spec.num_kv_heads and g.head_dim == spec.head_dim,
              f"KV cache of shape {tuple(shape)}; the {g.layout} layout is {g.form} "
              f"= {expected}")
        check(g.planes == spec.kv_planes,
              f"{g.layout} caches hold {g.planes} vector(s) per token and head; this "
              f"engine's KV holds {spec.kv_planes}")
        return g

    def to_chunks(self, spans: Sequence[ChunkSpan], *,  # type: ignore[override]
                  kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                  after: Any = None, **_: Any) -> None:
        """``after``: the forward's stream or an event on it (``TransferStream.store``),
        when the caller is not the forward's thread."""
        g, bound = self._validate(kv_caches, block_ids, max((s.end for s in spans), default=0))
        chunks = [(s.start, s.buffer) for s in spans]  # (as held: heads_outer)
        # On the transfer stream, after the forward that wrote the KV (lmkv.memory.transfer_stream);
        # the buffers are published to tiers and other threads next: after its event.
        stream_for(kv_caches[0].device).store(
            lambda: lmkv_kernels.gather_blocks(kv_caches, block_ids, chunks, layout=g.layout,
                                               heads_outer=self.spec.heads_outer, bound=bound),
            after=after).wait()

    def from_chunks(self, spans: Sequence[ChunkSpan], *,  # type: ignore[override]
                    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
                    skip_tokens: int = 0, after: Any = None, **_: Any) -> None:
        """``skip_tokens``: leave the request's first tokens alone (the engine
        already holds them, possibly in blocks other requests share). ``after``:
        the forward's stream (``TransferStream.load``), when the caller is not the
        forward's thread."""
        g, bound = self._validate(kv_caches, block_ids, max((s.end for s in spans), default=0))
        chunks = [(s.start, s.buffer) for s in spans]  # (as held: heads_outer)
        stream = stream_for(kv_caches[0].device)
        if stream.synchronous and bound.implementation is host_impl \
                and bound.host is not None:
            # host memory, no stream: copied here, now (the bound was found by these caches)
            host_impl.scatter_bound(kv_caches, block_ids, chunks, skip_tokens,
                                    self.spec.heads_outer, bound.host)
            return None
        # The compute stream's later kernels wait for the copy on the GPU; the chunk
        # buffers are released after this returns: after its event.
        stream.load(
            lambda: lmkv_kernels.scatter_blocks(kv_caches, block_ids, chunks, skip_tokens,
                                                layout=g.layout,
                                                heads_outer=self.spec.heads_outer, bound=bound),
            after=after).wait()
        return None

    def from_checked_chunks(self, spans: Sequence[ChunkSpan],  # type: ignore[override]
                            checksums: Sequence[int], *, kv_caches: Sequence[torch.Tensor],
                            block_ids: Sequence[int] | torch.Tensor, skip_tokens: int = 0,
                            **_: Any) -> list[bool] | None:
        """Checked loads (``GPUConnector.from_checked_chunks``) of chunks held heads
        outer into ``cpu`` caches, where the C copies were built with libxxhash
        (``lmkv_kernels.scatter_checked``): each chunk is read once, checked and
        copied by one thread; None otherwise."""
        if not (self.spec.heads_outer and _own_copies(type(self))) or not spans \
                or len(checksums) != len(spans):
            return None
        g, bound = self._validate(kv_caches, block_ids, max(s.end for s in spans))
        chunks = [(s.start, s.end, s.buffer, c) for s, c in zip(spans, checksums, strict=True)]
        return lmkv_kernels.scatter_checked(kv_caches, block_ids, chunks, skip_tokens,
                                            layout=g.layout, bound=bound)
