"""``Engine``: what every cache engine offers its callers, local or remote.

Callers (the transformers and vLLM integrations, the lookup responder, the
demo, benchmarks) type against this protocol and get an engine from
``lmkv.engines.open_engine``: whether the tiers live in this process
(``LocalEngine``) or in an lmkv server (``RemoteEngine``) is the config's
business, not theirs. ``RetrieveResult`` and ``EngineCounters`` are shared by
both engines, so they live here rather than in either.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmkv.config.model import LMKVConfig
    from lmkv.contracts.connector import GPUConnector, KVSpec
    from lmkv.keys.chunking import Identity, KeyMeta


@dataclass
class EngineCounters:
    spec_mismatches: int = 0  # chunks whose shape or dtype did not fit the engine: misses


@dataclass(frozen=True)
class RetrieveResult:
    num_tokens: int
    """Hit prefix length in tokens (whole chunks)."""
    kv: Any
    """What the connector returned: the KV it built, or None when it wrote in place."""


@runtime_checkable
class Engine(Protocol):
    """Tokens in, KV out: the surface both engines share.

    ``store``/``lookup``/``retrieve`` take the prompt's tokens and an optional
    ``identity`` (the same tokens under another identity are other chunks);
    ``kv`` keyword arguments go to the engine's GPU connector unchanged.
    ``lookup_and_prefetch*`` start loading the stored prefix for a later
    ``retrieve(..., lookup_id=...)``; ``release_lookup`` drops what was not taken.
    """

    config: LMKVConfig
    spec: KVSpec
    connector: GPUConnector
    counters: EngineCounters

    @property
    def block_size(self) -> int | None:
        """Tokens per block of block-granular hits; None: hits in whole chunks."""
        ...

    @property
    def meta(self) -> KeyMeta:
        """The key metadata (model, world size, rank, dtype, layout, geometry)."""
        ...

    def store(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None,
              **kv: Any) -> int:
        """Store the KV of the chunks not stored yet; returns tokens stored."""
        ...

    def lookup(self, tokens: Sequence[int] | Any, *, identity: Identity | None = None) -> int:
        """Length in tokens of the longest stored prefix of ``tokens``."""
        ...

    def lookup_and_prefetch(self, tokens: Sequence[int] | Any, lookup_id: str, *,
                            identity: Identity | None = None) -> Future:
        """Start loading the stored prefix; resolves to the hit length in tokens."""
        ...

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: Sequence[bytes],
                                   chunk_ends: Sequence[int],
                                   partial_hashes: Sequence[Sequence[bytes]] = (),
                                   block_tokens: int = 0) -> Future:
        """``lookup_and_prefetch`` for chunk hashes computed elsewhere;
        ``partial_hashes[i]``: chunk ``i``'s leading blocks' hashes
        (``lmkv.keys.chunking.block_prefix_hashes``, blocks of ``block_tokens``)."""
        ...

    def release_lookup(self, lookup_id: str) -> None:
        """Drop what ``lookup_id`` prefetched and nobody retrieved."""
        ...

    def retrieve(self, tokens: Sequence[int] | Any, *, lookup_id: str | None = None,
                 identity: Identity | None = None, **kv: Any) -> RetrieveResult:
        """Load the KV of the stored prefix of ``tokens`` through the connector."""
        ...

    def stats(self) -> list[dict[str, Any]]:
        """One dict of figures per tier."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...
