"""The GPUConnector ABC: moves KV between an engine's layout and chunk buffers.

A chunk buffer has the canonical shape ``[num_layers, 2, num_tokens,
num_kv_heads, head_dim]`` (K at index 0, V at 1): the layout tag ``l2thd`` in
each key. MLA's KV, one latent vector per token, is ``[num_layers, 1,
num_tokens, 1, latent_dim]`` (``KVSpec.kv_planes`` 1, tag ``l1thd``).
Connectors translate an engine's own layout (transformers per-layer tensors,
vLLM paged caches) to and from it, so KV stored by one engine layout can be
loaded into another, with the exception below.

A spec with ``heads_outer`` holds its chunks as ``[num_layers, num_kv_heads,
num_tokens, 2, head_dim]`` instead (tag ``lht2d``): the order of vLLM's CPU
caches, whose blocks then copy in runs of whole blocks instead of one row of
``head_dim`` at a time. Such chunks are named apart (the tag is in every key),
so an engine of the other order never reads them. ``KVSpec.planes_first``
gives any chunk buffer's canonical view; tokens are dimension 2 and layers
dimension 0 in both orders.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmkv.contracts.plugin import OptionsArg, Plugin
from lmkv.contracts.versions import declared_version, is_lmkv_class, parse_version

CHUNK_LAYOUT = "l2thd"


@dataclass(frozen=True)
class KVSpec:
    """Shape of an engine's KV: what a connector needs to size chunk buffers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: Vectors per token and KV head: 2 (K and V); 1 for MLA's latent (then
    #: ``num_kv_heads`` is 1 and ``head_dim`` the latent's size).
    kv_planes: int = 2
    #: Ranks that hold this very KV: MLA's latent is replicated on every
    #: tensor-parallel rank, so its keys name it once for all of them
    #: (``lmkv.engines.keys.engine_chunker``) instead of once per rank.
    replicas: int = 1
    #: Chunk buffers are ``[layers, kv_heads, tokens, planes, head_dim]`` (tag
    #: ``lht2d``) instead of ``[layers, planes, tokens, kv_heads, head_dim]``: set
    #: by a connector whose engine keeps each head's K and V of a token together
    #: (vLLM's CPU caches), where that order copies at memcpy speed.
    heads_outer: bool = False

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        if self.heads_outer:
            return (self.num_layers, self.num_kv_heads, num_tokens, self.kv_planes,
                    self.head_dim)
        return (self.num_layers, self.kv_planes, num_tokens, self.num_kv_heads, self.head_dim)

    def planes_first(self, buffer: torch.Tensor) -> torch.Tensor:
        """A chunk buffer of this spec (or a piece of its layers, or a slice of its
        tokens) as ``[layers, planes, tokens, kv_heads, head_dim]``: a view, the
        same memory."""
        return buffer.permute(0, 3, 2, 1, 4) if self.heads_outer else buffer

    def chunk_nbytes(self, num_tokens: int) -> int:
        return (self.num_layers * self.kv_planes * num_tokens * self.num_kv_heads
                * self.head_dim * self.dtype.itemsize)

    @property
    def chunk_layout(self) -> str:
        """The chunk layout tag in keys: ``l2thd``, ``l1thd`` for one plane (MLA),
        ``lht2d`` with ``heads_outer``."""
        if self.heads_outer:
            return f"lht{self.kv_planes}d"
        return CHUNK_LAYOUT if self.kv_planes == 2 else f"l{self.kv_planes}thd"


@dataclass(frozen=True)
class ChunkSpan:
    """Tokens ``[start, end)`` of a request and the chunk buffer that holds them."""

    start: int
    end: int
    buffer: torch.Tensor  # KVSpec.chunk_shape(end - start): tokens are dimension 2


@dataclass(frozen=True)
class ConnectorContext:
    """What lmkv hands a GPU connector besides its options (``cls(options, context)``)."""

    #: The engine's KV: layers, KV heads, head size, dtype.
    spec: KVSpec
    #: The layout of the engine's KV where the integration knows it (vLLM's
    #: attention backend: ``flash``, ``flashinfer``, ``cpu``, ``mla``); None: the
    #: connector reads it from the tensors.
    kv_layout: str | None = None


class GPUConnector(Plugin, ABC):
    """Copies KV between engine memory and chunk buffers, many chunks per call.

    Engine state comes in keyword arguments whose names each connector
    documents (``kv=`` for transformers, ``kv_caches=``/``block_ids=`` for
    paged caches).
    """

    #: The order of the chunk buffers the connector fills and reads, the tag in
    #: the keys of two-plane KV: ``l2thd``; a connector that takes a
    #: ``heads_outer`` spec says ``lht2d`` (engines refuse a connector whose tag
    #: differs from such a spec's, rather than name one order's bytes as the other).
    chunk_layout: str = CHUNK_LAYOUT
    #: What kind of engine KV the connector takes: integrations check it (the
    #: transformers integration needs "hf"; vLLM's paged caches are "paged"; each
    #: kind's default connector is in ``lmkv.config.model.DEFAULT_CONNECTORS``).
    kv_kind: str = ""
    #: True when ``from_chunks`` writes into KV the engine owns (paged caches), so
    #: chunks can be copied in batch by batch as tiers deliver them.
    writes_in_place: bool = False

    @classmethod
    def spec_from(cls, **kv: Any) -> KVSpec:
        """The KV spec of engine state given as ``to_chunks`` takes it, for
        integrations that learn it from the engine's own tensors (vLLM hands its
        paged caches over, not their geometry). The connector reads its layout
        there, so the decision is made in one place; connectors that cannot say
        raise NotImplementedError."""
        raise NotImplementedError(f"gpu_connector {cls.name!r} cannot read a KV spec from "
                                  "the engine's tensors")

    def __init__(self, options: OptionsArg, context: ConnectorContext) -> None:
        self.options = self.parse_options(options)
        self.context = context
        self.spec = context.spec

    @abstractmethod
    def to_chunks(self, spans: Sequence[ChunkSpan], **kv: Any) -> None:
        """Copy the engine's KV of each span into its buffer (store path).

        ``after=`` (when given): the stream the engine's forward runs on, or a CUDA
        event recorded there, that the copy must follow instead of the calling
        thread's current stream (``lmkv.memory.transfer_stream``): the caller may be
        another thread than the forward's."""

    @abstractmethod
    def from_chunks(self, spans: Sequence[ChunkSpan], **kv: Any) -> Any:
        """Copy each span's buffer into the engine's KV (retrieve path).

        Returns the KV it wrote to when the connector builds it itself (see the
        connector's docs), else None. ``after=``: as for ``to_chunks``.
        """

    def from_checked_chunks(self, spans: Sequence[ChunkSpan], checksums: Sequence[int],
                            **kv: Any) -> list[bool] | None:
        """``from_chunks`` of whole stored chunks, each one's bytes checked as they
        are copied (API 2.2; optional: lmkv calls it where a class written for 2.2
        defines it, and none below that class replaces ``from_chunks``).

        Each span's buffer is a whole stored chunk, contiguous, as the spec holds
        it; it may hold more tokens than the span, of which the first ``end -
        start`` are copied. ``checksums[i]`` is the xxh3-64 (seed 0) of all of
        buffer ``i``'s bytes. Returns, per span, whether the bytes read matched
        (a span that did not may be in the KV in part: the caller treats its
        blocks as never loaded), or None, having copied nothing, where the
        connector does not check these buffers or this KV: lmkv then reads each
        chunk in pieces, checks it itself and copies with ``from_chunks``. A
        buffer may be a file's bytes mapped into memory: read each byte once,
        and check the bytes copied, not a second read of them. The base class
        checks nothing (None)."""
        return None


def checked_loads(connector: GPUConnector) -> Callable[..., list[bool] | None] | None:
    """``connector.from_checked_chunks`` where lmkv may call it: defined by a class
    of the connector's written for GPU connector API 2.2 or later, with no class
    below it replacing ``from_chunks`` (that subclass copies its own way), and the
    connector's class written for 2.2 too (the load check bound the method's
    arguments) unless the method is lmkv's own; else None."""
    def since_2_2(klass: type) -> bool:
        version = parse_version(declared_version(klass, GPUConnector))
        return version is not None and version >= (2, 2)

    cls = type(connector)
    for klass in cls.__mro__:
        if klass is GPUConnector:
            return None
        if "from_checked_chunks" in vars(klass):
            if since_2_2(klass) and (is_lmkv_class(klass) or since_2_2(cls)):
                return connector.from_checked_chunks
            return None
        if "from_chunks" in vars(klass):
            return None
    return None
