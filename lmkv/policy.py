"""ABCs of the two policy kinds: eviction (per tier) and lazy offload (per engine)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmkv.plugin_base import NoOptions, OptionsArg, Plugin


@dataclass(frozen=True)
class EvictionContext:
    """What lmkv hands an eviction policy besides its options (``cls(options, context)``)."""

    #: The position in ``tiers`` of the tier this policy orders.
    tier_index: int = 0


class EvictionPolicy(Plugin, ABC):
    """Orders a tier's keys for eviction. The tier skips pinned or referenced
    entries, so a policy only ranks; it never decides what is safe to drop."""

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        self.options = self.parse_options(options)
        self.context = EvictionContext() if context is None else context

    @abstractmethod
    def on_insert(self, key: Hashable) -> None:
        """A key was stored."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None:
        """A stored key was read."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """A key left the tier (removed or evicted)."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Stored keys, the one to evict first first. The tier may stop early."""


class StoreMeta(Protocol):
    """What an offload policy needs of one step's store metadata."""

    req_id: str


@dataclass
class OffloadItem:
    """The pending stores of one request, aggregated over its scheduling steps."""

    req_id: str
    metas: list[Any] = field(default_factory=list)
    block_hashes: dict[int, Any] = field(default_factory=dict)
    finished: bool = False


@dataclass(frozen=True)
class OffloadContext:
    """What lmkv hands a lazy-offload policy besides its options (``cls(options, context)``)."""

    #: Finished requests to wait for before offloading (``lazy_offload_threshold``).
    threshold: int
    #: Seconds, for policies that age requests (tests pass a fake clock).
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) \
                or self.threshold <= 0:
            raise ValueError(f"threshold must be a positive integer, got {self.threshold!r}")


class OffloadPolicy(Plugin, ABC):
    """Decides which finished requests' stores to submit, and when (lazy offload).

    ``context.threshold`` is the engine config key ``lazy_offload_threshold``;
    the ``count`` it pops is ``lazy_offload_select_count``.
    """

    Options = NoOptions

    def __init__(self, options: OptionsArg, context: OffloadContext) -> None:
        self.options = self.parse_options(options)
        self.context = context
        self.threshold = context.threshold

    @abstractmethod
    def add(self, meta: StoreMeta, block_hashes: Mapping[int, Any]) -> None:
        """Buffer one step's store metadata with a snapshot of its blocks' hashes."""

    @abstractmethod
    def mark_req_finished(self, req_id: str) -> None:
        """The engine finished ``req_id``; raise ValueError if it is not pending."""

    @abstractmethod
    def pop_items_for_offload(self, count: int) -> Sequence[OffloadItem]:
        """At most ``count`` items to submit now (possibly none)."""

    @property
    @abstractmethod
    def ready_count(self) -> int:
        """Finished requests waiting to be offloaded."""

    @abstractmethod
    def __len__(self) -> int:
        """Pending requests, finished or not."""
