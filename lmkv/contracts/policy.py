"""ABCs of the two policy kinds: eviction (per tier) and lazy offload (per engine)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, ClassVar, Protocol, final

from lmkv.contracts.plugin import NoOptions, OptionsArg, Plugin, PluginOptions
from lmkv.contracts.versions import declared_version, parse_version


@dataclass(frozen=True)
class EvictionContext:
    """What lmkv hands an eviction policy besides its options (``cls(options, context)``)."""

    #: The position in ``tiers`` of the tier this policy orders.
    tier_index: int = 0


_ABSENT = object()


class Lineage:
    """Who extends whom among one tier's stored keys.

    Each stored key has a parent: the key of the chunk before it in its prompt
    (None for a prompt's first chunk, or when the tier was not told). A key that
    no stored key names as its parent is a leaf. Lookups are strict prefixes, so
    a chunk whose head went is dead weight: a tier evicts leaves only, as a
    radix tree does, and a prompt's chunks go tail first.

    Memory is bounded by the stored keys: one parent link per key and one child
    count per key that some stored key extends.
    """

    __slots__ = ("_children", "_parent")

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}

    def add(self, key: Hashable, parent: Hashable | None = None) -> None:
        """``key`` is stored, extending ``parent`` (stored in this tier or not)."""
        if key in self._parent:
            self.discard(key)
        if parent == key:
            parent = None
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def discard(self, key: Hashable) -> None:
        """``key`` left the tier; its parent may now be a leaf."""
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]

    def parent(self, key: Hashable) -> Hashable | None:
        return self._parent.get(key)

    def children(self, key: Hashable) -> int:
        """How many stored keys extend ``key``."""
        return self._children.get(key, 0)

    def is_leaf(self, key: Hashable) -> bool:
        """No stored key extends ``key``: it may be evicted."""
        return key not in self._children

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)


class SlotLineage:
    """``Lineage`` of a tier's slots (dense ints from 0, ``lmkv.keys.slots``), in
    arrays: a parent and a child count per slot, no Python object per key.

    The same questions as ``Lineage``; a slot that is not stored but that stored
    slots extend (its chunk was never stored here, or went) keeps its count.
    """

    __slots__ = ("_children", "_count", "_parent")

    _ABSENT = -2  # a slot not stored
    _ROOT = -1  # a stored slot without a parent

    def __init__(self) -> None:
        self._parent = array("i")
        self._children = array("i")
        self._count = 0

    def _reach(self, slot: int) -> None:
        """Grow the arrays to hold ``slot`` (doubling: amortized O(1))."""
        size = len(self._parent)
        if slot >= size:
            more = max(slot + 1 - size, size >> 3, 1024)
            self._parent.extend(repeat(self._ABSENT, more))
            self._children.extend(repeat(0, more))

    def add(self, key: Any, parent: Any = None) -> None:
        """Slot ``key`` is stored, extending slot ``parent`` (stored or not)."""
        if key in self:
            self.discard(key)
        if parent == key:
            parent = None
        self._reach(max(key, -1 if parent is None else parent))
        self._parent[key] = self._ROOT if parent is None else parent
        self._count += 1
        if parent is not None:
            self._children[parent] += 1

    def discard(self, key: Any) -> None:
        """Slot ``key`` left the tier; its parent may now be a leaf."""
        if key not in self:
            return
        parent = self._parent[key]
        self._parent[key] = self._ABSENT
        self._count -= 1
        if parent >= 0:
            self._children[parent] -= 1

    def parent(self, key: Any) -> Any:
        parent = self._parent[key] if 0 <= key < len(self._parent) else -1
        return parent if parent >= 0 else None

    def children(self, key: Any) -> int:
        """How many stored slots extend ``key``."""
        return self._children[key] if 0 <= key < len(self._children) else 0

    def is_leaf(self, key: Any) -> bool:
        """No stored slot extends ``key``: it may be evicted."""
        return self.children(key) == 0

    def __contains__(self, key: object) -> bool:
        return (type(key) is int and 0 <= key < len(self._parent)
                and self._parent[key] != self._ABSENT)

    def __len__(self) -> int:
        return self._count


class EvictionPolicy(Plugin, ABC):
    """Orders a tier's keys for eviction.

    A tier calls the final methods ``insert`` / ``access`` / ``forget`` /
    ``candidates``; a policy implements the ``on_*`` hooks and ``victims``.
    The base keeps the tier's ``lineage`` (each key's parent) and hands the
    tier only leaves, so no policy, built-in or third-party, can orphan a
    prefix: ``victims`` ranks, ``candidates`` filters. The tier also skips
    pinned or referenced entries, so a policy never decides what is safe to
    drop. A policy that yields leaves first (``lineage.is_leaf``) saves the
    filter its skips; ``on_extended`` / ``on_leaf`` tell it when a stored key
    stops or starts being a leaf, so it can keep only leaves in its order.
    A key may be stored after a key that extends it (a tail promoted before
    its head): ``on_insert`` then sees ``lineage.is_leaf(key)`` false.
    """

    #: Told ``(key, True)`` when the tier stores a key, ``(key, False)`` when one
    #: leaves it (``watch``); None, the default, costs one attribute test.
    _watcher: Callable[[Hashable, bool], None] | None = None

    #: Set by a policy that can order a tier's slots (dense ints from 0, see
    #: ``lmkv.keys.slots``) in arrays, without a Python object per key: a tier
    #: that numbers its keys calls ``order_slots`` before its first ``insert``,
    #: and the policy's hooks then see slots (and ``lineage`` is a
    #: ``SlotLineage``). Such a policy implements ``use_slots``.
    orders_slots: ClassVar[bool] = False
    #: A slot's key, for the watcher (set by ``order_slots``).
    _key_of: Callable[[int], Hashable] | None = None

    def __init__(self, options: OptionsArg = None, context: EvictionContext | None = None) -> None:
        self.options = self.parse_options(options)
        self.context = EvictionContext() if context is None else context
        #: The stored keys' parents and child counts (kept by the base).
        self.lineage = Lineage()
        self._slots: SlotLineage | None = None
        self._hooks: dict[str, Any] = {}  # the batch hooks found (``_batched``)

    @final
    def order_slots(self, key_of: Callable[[int], Hashable]) -> None:
        """From now on the tier names its keys by slot (``orders_slots`` policies
        only, before the first ``insert``); ``key_of(slot)`` is the slot's key,
        which a watcher is told."""
        if not self.orders_slots:
            raise TypeError(f"eviction policy {self.name!r} does not order slots")
        if len(self.lineage):
            raise RuntimeError("order_slots after keys were inserted")
        self._slots = SlotLineage()
        # The same questions, by slot (a policy that orders slots asks them so).
        self.lineage = self._slots  # type: ignore[assignment]
        self._key_of = key_of
        self.use_slots()

    def use_slots(self) -> None:
        """The hooks see slots from now on (called once, by ``order_slots``, before
        any key): a policy that sets ``orders_slots`` switches its order to arrays."""
        raise NotImplementedError(f"eviction policy {self.name!r} sets orders_slots "
                                  "but does not implement use_slots")

    # -- what a tier calls ----------------------------------------------------
    @final
    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        """``key`` was stored, extending ``parent`` (the chunk before it, or None).

        Storing a stored key again is forgetting it, then storing it (tiers never
        do; a policy's ``on_insert`` only ever sees keys it does not hold).
        """
        if self._slots is not None:
            self._insert_slot(key, parent)  # type: ignore[arg-type]
            return
        # The tiers call this for every chunk they store: dict operations, inlined.
        lineage = self.lineage
        parents, children = lineage._parent, lineage._children
        if key in parents:
            self.forget(key)
        extended = False
        if parent is not None:
            if parent == key:
                parent = None
            else:
                # A stored leaf that gains its first stored extension stops being one.
                extended = parent in parents and parent not in children
                children[parent] = children.get(parent, 0) + 1
        parents[key] = parent
        if extended:
            self.on_extended(parent)
        self.on_insert(key, parent)
        if self._watcher is not None:
            self._watcher(key, True)

    def _insert_slot(self, key: int, parent: int | None) -> None:
        """``insert`` for slots: the same steps, on the lineage's arrays (inlined:
        the tiers call this for every chunk they store)."""
        lineage = self._slots
        assert lineage is not None
        parents, children = lineage._parent, lineage._children
        if parent == key:
            parent = None
        top = key if parent is None or parent < key else parent
        if top >= len(parents):
            lineage._reach(top)
        if parents[key] != -2:  # stored: forget it first
            self.forget(key)
        extended = False
        if parent is None:
            parents[key] = -1
        else:
            # A stored leaf that gains its first stored extension stops being one.
            extended = parents[parent] != -2 and not children[parent]
            children[parent] += 1
            parents[key] = parent
        lineage._count += 1
        if extended:
            self.on_extended(parent)
        self.on_insert(key, parent)
        if self._watcher is not None:
            self._watcher(self._key_of(key), True)  # type: ignore[misc]

    @final
    def insert_many(self, keys: Sequence[Hashable],
                    parents: Sequence[Hashable | None] | None = None) -> None:
        """``insert`` of each of ``keys`` with its parent (``parents``; None: every
        key a root), in order: what a tier calls for a batch it stored."""
        if parents is None:
            parents = [None] * len(keys)
        elif len(parents) != len(keys):
            raise ValueError(f"insert_many: {len(keys)} keys but {len(parents)} parents")
        hook = self._batched("on_insert_many") if self._slots is not None else None
        if hook is None:
            for key, parent in zip(keys, parents, strict=True):
                self.insert(key, parent)
            return
        self._insert_slots(hook, keys, parents)  # type: ignore[arg-type]

    def _insert_slots(self, hook: Callable[..., None], keys: Sequence[int],
                      parents: Sequence[int | None]) -> None:
        """``insert_many`` of slots, for a policy with ``on_insert_many``: the
        lineage of the whole batch first, then the hook once (a stored key, which
        tiers never insert again, splits the batch and goes through ``insert``)."""
        lineage = self._slots
        assert lineage is not None
        stored, children = lineage._parent, lineage._children
        top = max(keys, default=-1)
        for parent in parents:
            if parent is not None and parent > top:
                top = parent
        if top >= len(stored):
            lineage._reach(top)
        run: list[int] = []
        run_parents: list[int | None] = []
        for key, parent in zip(keys, parents, strict=True):
            if stored[key] != -2:
                self._insert_run(hook, run, run_parents)
                run, run_parents = [], []
                self.insert(key, parent)
                continue
            if parent is None or parent == key:
                stored[key] = -1
                parent = None
            else:
                children[parent] += 1
                stored[key] = parent
            run.append(key)
            run_parents.append(parent)
        self._insert_run(hook, run, run_parents)

    def _insert_run(self, hook: Callable[..., None], keys: list[int],
                    parents: list[int | None]) -> None:
        """The policy's ``on_insert_many`` for a run whose lineage is in place."""
        if not keys:
            return
        assert self._slots is not None
        self._slots._count += len(keys)
        hook(keys, parents)
        if self._watcher is not None:
            key_of, watcher = self._key_of, self._watcher
            for key in keys:
                watcher(key_of(key), True)  # type: ignore[misc]

    @final
    def access(self, key: Hashable) -> None:
        """A stored key was read."""
        self.on_access(key)

    @final
    def access_many(self, keys: Sequence[Hashable]) -> None:
        """``access`` of each of ``keys``, in order: a tier's batch of reads."""
        hook = self._batched("on_access_many")
        if hook is not None:
            hook(keys)
            return
        on_access = self.on_access
        for key in keys:
            on_access(key)

    def _batched(self, name: str) -> Callable[..., None] | None:
        """The policy's batch hook ``name`` when it may stand for its per-key hooks:
        a class written for eviction policy API 2.2 or later defines it, and no
        class of the policy below that one replaces a per-key hook it stands for
        (a subclass of ``lru`` with its own ``on_insert`` gets one call per key).
        lmkv calls this base's ``insert_many`` and ``access_many`` whatever a
        class written for 2.0 or 2.1 has under those names."""
        found = self._hooks.get(name, _ABSENT)
        if found is _ABSENT:
            found = None
            per_key = _BATCH_HOOKS[name]
            for klass in type(self).__mro__:
                if klass is EvictionPolicy:
                    break
                if name in vars(klass):  # written for 2.2 by that class
                    version = parse_version(declared_version(klass, EvictionPolicy))
                    if version is not None and version >= (2, 2):
                        found = getattr(self, name)
                    break
                if any(hook in vars(klass) for hook in per_key):
                    break
            self._hooks[name] = found
        return found

    @final
    def forget(self, key: Hashable) -> None:
        """``key`` left the tier (removed or evicted)."""
        if self._slots is not None:
            self._forget_slot(key)  # type: ignore[arg-type]
            return
        lineage = self.lineage
        parents, children = lineage._parent, lineage._children
        parent = parents.pop(key, _ABSENT)
        if parent is _ABSENT:
            self.on_remove(key)  # not in the lineage: let the policy drop what it has
            return
        left = 1
        if parent is not None:
            left = children[parent] - 1
            if left:
                children[parent] = left
            else:
                del children[parent]
        self.on_remove(key)
        if not left and parent in parents:
            self.on_leaf(parent)  # its last stored extension left: a candidate again
        if self._watcher is not None:
            self._watcher(key, False)

    def _forget_slot(self, key: int) -> None:
        lineage = self._slots
        assert lineage is not None
        parents, children = lineage._parent, lineage._children
        parent = parents[key] if 0 <= key < len(parents) else -2
        if parent == -2:
            self.on_remove(key)  # not in the lineage: let the policy drop what it has
            return
        parents[key] = -2
        lineage._count -= 1
        left = 1
        if parent >= 0:
            left = children[parent] - 1
            children[parent] = left
        self.on_remove(key)
        if not left and parents[parent] != -2:
            self.on_leaf(parent)  # its last stored extension left: a candidate again
        if self._watcher is not None:
            self._watcher(self._key_of(key), False)  # type: ignore[misc]

    @final
    def watch(self, watcher: Callable[[Hashable, bool], None] | None) -> None:
        """Tell ``watcher`` of every key the tier stores (``(key, True)``) or drops,
        evicted or removed (``(key, False)``); None stops it. Every tier that evicts
        stores and drops through its policy, so this sees exactly its contents.
        ``watcher`` runs under the tier's lock, on whichever thread changed the
        tier: it must be quick and never call into the tier (queue and return)."""
        self._watcher = watcher

    @final
    def candidates(self) -> Iterator[Hashable]:
        """``victims`` that no stored key extends (leaves), in the policy's order."""
        if self._slots is not None:
            yield from self._slot_candidates(self._slots)
            return
        parents, children = self.lineage._parent, self.lineage._children
        for key in self.victims():
            if key not in children and key in parents:
                yield key

    def _slot_candidates(self, lineage: SlotLineage) -> Iterator[int]:
        stored, extended = lineage._parent, lineage._children
        slot: Any
        for slot in self.victims():
            if stored[slot] != SlotLineage._ABSENT and not extended[slot]:
                yield slot

    # -- what a policy implements ---------------------------------------------
    @abstractmethod
    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        """A key was stored; ``parent`` is the key it extends (None: a root)."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None:
        """A stored key was read."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """A key left the tier (removed or evicted)."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Stored keys, the one to evict first first. The tier may stop early.

        May include keys that are not leaves; ``candidates`` drops them (a policy
        that keeps only leaves in its order, with ``on_extended`` / ``on_leaf``,
        never makes it skip, so an eviction costs what it evicts).
        """

    def on_insert_many(self, keys: list[Any], parents: list[Any]) -> None:
        """Optional (eviction policy API 2.2; policies ordering slots): ``keys``
        were stored, in order, each extending its parent (None: a root). Called
        once the lineage holds all of them (``lineage.children`` counts
        extensions stored later in the batch, and ``lineage.is_leaf`` of a stored
        key one of them extends is false already): leave the policy as
        ``on_extended`` and ``on_insert`` key by key would have. Not defined: lmkv
        calls those instead (this base's is never called)."""
        raise NotImplementedError

    def on_access_many(self, keys: Sequence[Any]) -> None:
        """Optional (eviction policy API 2.2): ``on_access`` of each of ``keys``, in
        order. Not defined: lmkv calls ``on_access`` per key (this base's is never
        called)."""
        raise NotImplementedError

    def on_extended(self, key: Hashable) -> None:
        """The stored leaf ``key`` gained its first stored extension: it is no longer
        a candidate until ``on_leaf``. Called before the extension's ``on_insert``.
        A policy that orders leaves only takes ``key`` out of its order here."""

    def on_leaf(self, key: Hashable) -> None:
        """The stored key ``key`` is a leaf again: its last stored extension left
        (called after that one's ``on_remove``). A policy that orders leaves only
        puts ``key`` back here, where its own history says it belongs."""


#: The per-key hooks a batch hook stands for (``EvictionPolicy._batched``).
_BATCH_HOOKS: dict[str, tuple[str, ...]] = {
    "on_insert_many": ("on_insert", "on_extended", "use_slots"),
    "on_access_many": ("on_access", "use_slots"),
}


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

    Options: ClassVar[type[PluginOptions]] = NoOptions

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
