"""The storage-backend conformance suite.

Subclass ``StorageBackendConformance`` in a class whose name starts with
``Test``, name your tier class and the options a config would give it; every
test below then runs against your tier, built the way lmkv builds it (its
``Options`` validated, ``cls(options, context)`` with the context a storage
manager hands it)::

    class TestMyBackend(StorageBackendConformance):
        backend_class = MyBackend

        def backend_options(self):
            return {"url": "..."}          # per test: paths, ports, key prefixes

What a tier must do beyond its own methods is checked too, because that is
where a tier that passes alone breaks at run time: the class passes lmkv's
load check (its contract version, no abstract method left, every method lmkv
calls callable the way lmkv calls it); it stores and reads with each built-in
eviction policy; it hands its policy each chunk's parent; and it serves a
real storage manager built from a config that names it (stores written
through, lookups, prefetches, gets, promotion).

``make_backend`` builds the tier used by most tests (by default
``build_backend()``); override it only to add what lmkv's path cannot give
(and keep the class and options above: the checks of lmkv's path use them).
Fault injection: implement ``corrupt_entry`` and ``copy_entry`` (a tier that
stores bytes) and ``make_unreachable`` (a tier whose storage can be out of
reach) and the fault tests run too; each hook left alone skips its tests.

Across processes: another process opens the tier by its registered name and
the options ``make_backend`` gave it, stores, exits, and the chunks must read
back here (``lmkv.testing.cross_process``). A tier whose storage is its
process's memory sets ``outlives_process = False`` and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch

from lmkv.contracts.direct_chunk import DirectChunk
from lmkv.contracts.policy import EvictionPolicy
from lmkv.contracts.tier import StorageBackend
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryObj, release, tensor_obj
from lmkv.storage.manager import StorageManager, looks_up_in_memory
from lmkv.testing.building import load_problem, selectable, storage_from
from lmkv.testing.cross_process import check_read_across_processes, given_options
from lmkv.testing.tiers import strict_refcounts

#: lmkv's own eviction policies: a tier must work with each of them.
BUILTIN_EVICTION_POLICIES = ("lru", "lfu", "arc", "s3fifo")


class ParentRecorder(EvictionPolicy):
    """An eviction policy that remembers the parent each key was stored with
    (``insert(key, parent)``), to check that a tier hands its policy what lmkv
    gave the tier. It evicts oldest first."""

    name = "lmkv-conformance-recorder"
    api_version = "2.0"
    #: key -> parent of every insert, across instances (the kit reads it back).
    seen: dict[Hashable, Hashable | None] = {}

    def __init__(self, options: Any = None, context: Any = None) -> None:
        super().__init__(options, context)
        self._order: dict[Hashable, None] = {}

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        ParentRecorder.seen[key] = parent
        self._order[key] = None

    def on_access(self, key: Hashable) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self._order))


class StorageBackendConformance:
    """Contract tests every storage backend passes."""

    chunk_shape: tuple[int, ...] = (2, 2, 16, 2, 32)
    dtype: torch.dtype = torch.float16
    meta = KeyMeta("conformance-model", 1, 0, "float16", "l2thd")

    #: The tier class under test. Installed or not: the kit makes it selectable
    #: by its name for its tests.
    backend_class: type[StorageBackend] | None = None

    def backend_options(self) -> dict[str, Any]:
        """The ``options`` a config would give the tier (fresh per test)."""
        return {}

    def make_backend(self) -> StorageBackend:
        """The tier most tests use; by default built the way lmkv builds it."""
        return self.build_backend()

    def build_backend(self, eviction: str = "lru") -> StorageBackend:
        """``backend_class`` with ``backend_options()`` and ``eviction``, built by a
        storage manager from a config that names it (closed after the test)."""
        return self.build_storage([self._tier_ref(eviction)]).tiers[0]

    def build_storage(self, tiers: list[dict[str, Any]]) -> StorageManager:
        """A storage manager built by lmkv from a config of ``tiers``; the kit closes
        it after the test."""
        with selectable(self._backend_class(), ParentRecorder):
            storage = storage_from(tiers)
        self._storages.append(storage)
        return storage

    def _tier_ref(self, eviction: str = "lru") -> dict[str, Any]:
        return {"type": self._backend_class().name, "options": self.backend_options(),
                "eviction": eviction}

    def _backend_class(self) -> type[StorageBackend]:
        if self.backend_class is None:
            pytest.fail("set backend_class (and backend_options) on the kit's subclass: "
                        "the kit builds and checks the tier the way lmkv does")
        return self.backend_class

    def corrupt_entry(self, backend: StorageBackend, key: CacheKey) -> bool:
        """Damage the stored value of ``key`` behind the backend's back (flip a
        payload bit). Tiers that store bytes implement it; the default returns
        False and the corruption test is skipped."""
        return False

    def copy_entry(self, backend: StorageBackend, source: CacheKey, target: CacheKey) -> bool:
        """Store the bytes of ``source``'s entry under ``target``'s name behind the
        backend's back (a file copied or renamed, a Redis value moved). Tiers that
        store bytes implement it; the default returns False and the test is skipped."""
        return False

    def make_unreachable(self, backend: StorageBackend) -> AbstractContextManager[None] | None:
        """A context manager inside which ``backend``'s storage cannot be reached
        (an endpoint stopped, a server hung, a directory gone) and after which it
        is back, with what it held. Tiers with storage outside this process
        implement it; the default returns None and the unreachable test is
        skipped (a tier to which it does not apply skips with its reason)."""
        return None

    #: How long a tier may take to find its storage back (breaker backoff,
    #: reconnect): a liveness bound for the recovery test, never a timing.
    recovery_deadline_s: float = 60.0

    def make_bounded_backend(self, max_bytes: int) -> StorageBackend | None:
        """A fresh backend with a byte budget of about ``max_bytes``, for the
        eviction tests. Only asked when ``make_backend``'s has no budget
        (``capacity_bytes`` None); tiers that can have one return it, the default
        returns None and those tests are skipped."""
        return None

    #: Upper bound on the chunks the eviction tests write.
    max_pressure_chunks: int = 2048

    #: Whether what the tier stores outlives the process that stored it (a
    #: directory, a server, a pool); False skips the cross-process test with
    #: ``per_process_reason``.
    outlives_process: bool = True
    per_process_reason: str = ""

    def process_options(self, backend: StorageBackend) -> dict[str, Any]:
        """The options another process opens ``backend``'s tier with: by default the
        options ``backend`` was given. A tier whose process must not hold the
        storage itself (a pool segment that goes with it) adjusts them."""
        return given_options(backend.options)

    # -- helpers -------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _close_storages(self) -> Iterator[None]:
        self._storages: list[StorageManager] = []
        yield
        for storage in self._storages:
            storage.close()

    @pytest.fixture(autouse=True)
    def _strict_refcounts(self) -> Iterator[None]:
        """A reference released once too often raises (it only logs in production):
        a tier that hands out its own reference fails here, not in a deployment."""
        with strict_refcounts():
            yield

    @pytest.fixture
    def backend(self) -> Iterator[StorageBackend]:
        backend = self.make_backend()
        try:
            yield backend
        finally:
            backend.close()

    def key(self, i: int) -> CacheKey:
        return CacheKey(self.meta, i.to_bytes(4, "little") * 8)

    def make_obj(self, backend: StorageBackend, seed: int) -> MemoryObj:
        gen = torch.Generator().manual_seed(seed)
        data = torch.randn(self.chunk_shape, generator=gen).to(self.dtype)
        obj = backend.allocate(self.chunk_shape, self.dtype)
        if obj is None:
            return tensor_obj(data)
        obj.tensor.copy_(data)
        return obj

    def chunk_bytes(self) -> int:
        return torch.Size(self.chunk_shape).numel() * self.dtype.itemsize

    def put(self, backend: StorageBackend, ids: list[int]) -> list[torch.Tensor]:
        objs = [self.make_obj(backend, i) for i in ids]
        expected = [o.tensor.clone() for o in objs]
        stored = backend.batched_submit_put([self.key(i) for i in ids], objs).result(timeout=30)
        for obj in objs:
            obj.ref_down()
        assert stored == len(ids)
        return expected

    # -- the contract -----------------------------------------------------------
    def test_missing_key_is_a_miss(self, backend: StorageBackend) -> None:
        assert not backend.contains(self.key(1))
        assert backend.get_blocking(self.key(1)) is None
        assert backend.batched_async_contains("l", [self.key(1), self.key(2)]) == 0

    def test_put_then_get_returns_identical_bytes(self, backend: StorageBackend) -> None:
        (expected,) = self.put(backend, [7])
        obj = backend.get_blocking(self.key(7))
        assert obj is not None
        try:
            assert obj.dtype == self.dtype
            assert tuple(obj.shape) == self.chunk_shape
            assert torch.equal(obj.tensor, expected)
        finally:
            obj.ref_down()

    def test_put_completion_is_observable(self, backend: StorageBackend) -> None:
        obj = self.make_obj(backend, 1)
        future = backend.batched_submit_put([self.key(1)], [obj])
        obj.ref_down()
        assert future.result(timeout=30) == 1
        assert backend.contains(self.key(1))

    def test_put_of_a_stored_key_keeps_one_entry(self, backend: StorageBackend) -> None:
        self.put(backend, [3])
        usage = backend.usage_bytes
        obj = self.make_obj(backend, 3)
        backend.batched_submit_put([self.key(3)], [obj]).result(timeout=30)
        obj.ref_down()
        assert backend.usage_bytes == usage

    def test_async_contains_counts_the_leading_prefix(self, backend: StorageBackend) -> None:
        # Keys no other test of the kit stores: a backend shared between tests (a
        # Redis server the fixture empties) can never make key 43 present here.
        self.put(backend, [40, 41, 42, 44])
        keys = [self.key(i) for i in range(40, 45)]
        assert backend.batched_async_contains("l", keys) == 3
        assert backend.batched_async_contains("l", keys[3:]) == 0
        assert backend.batched_async_contains("l", []) == 0

    def test_async_contains_pins_the_hits(self, backend: StorageBackend) -> None:
        self.put(backend, [0, 1])
        keys = [self.key(0), self.key(1), self.key(2)]
        assert backend.batched_async_contains("l", keys, pin=True) == 2
        assert backend.unpin(self.key(0))
        assert backend.unpin(self.key(1))
        assert not backend.unpin(self.key(2))

    def test_pin_and_unpin_report_presence(self, backend: StorageBackend) -> None:
        self.put(backend, [5])
        assert backend.pin(self.key(5))
        assert backend.unpin(self.key(5))
        assert not backend.pin(self.key(6))
        assert not backend.unpin(self.key(6))

    def test_non_blocking_get_returns_the_leading_hits(self, backend: StorageBackend) -> None:
        expected = self.put(backend, [0, 1, 3])
        keys = [self.key(i) for i in range(4)]
        objs = backend.batched_get_non_blocking("l", keys).result(timeout=30)
        try:
            assert len(objs) == 2
            for obj, data in zip(objs, expected[:2], strict=True):
                assert torch.equal(obj.tensor, data)
        finally:
            for obj in objs:
                obj.ref_down()

    def test_a_released_get_leaves_the_entry_readable(self, backend: StorageBackend) -> None:
        (expected,) = self.put(backend, [9])
        for _ in range(3):
            obj = backend.get_blocking(self.key(9))
            assert obj is not None and torch.equal(obj.tensor, expected)
            obj.ref_down()

    def test_remove(self, backend: StorageBackend) -> None:
        self.put(backend, [1])
        assert backend.remove(self.key(1))
        assert not backend.contains(self.key(1))
        assert backend.get_blocking(self.key(1)) is None
        assert not backend.remove(self.key(1))

    def test_remove_frees_usage(self, backend: StorageBackend) -> None:
        start = backend.usage_bytes
        for _ in range(20):
            self.put(backend, [1, 2, 3])
            assert backend.usage_bytes > start
            for i in (1, 2, 3):
                assert backend.remove(self.key(i))
        assert backend.usage_bytes == start

    def test_capacity_is_reported(self, backend: StorageBackend) -> None:
        capacity = backend.capacity_bytes
        assert capacity is None or capacity > 0

    def test_close_is_idempotent(self, backend: StorageBackend) -> None:
        self.put(backend, [1])
        backend.close()
        backend.close()

    def test_a_corrupt_entry_is_a_miss_and_is_removed(self, backend: StorageBackend) -> None:
        self.put(backend, [4])
        if not self.corrupt_entry(backend, self.key(4)):
            pytest.skip("this backend keeps no bytes to corrupt (corrupt_entry)")
        before = backend.stats()
        assert backend.get_blocking(self.key(4)) is None
        after = backend.stats()
        assert after["corrupt_frames"] == before["corrupt_frames"] + 1
        assert after["misses"] > before["misses"] and after["hits"] == before["hits"]
        assert not backend.contains(self.key(4)), "a corrupt entry must be removed"
        (expected,) = self.put(backend, [4])  # the key is free for a good entry again
        self._check_reads(backend, 4, expected)

    def test_a_corrupt_entry_ends_a_batched_get(self, backend: StorageBackend) -> None:
        """The batched path goes through the same policy: the prefix before the
        corrupt entry, the entry removed and counted once."""
        expected = self.put(backend, [1, 2, 3])
        if not self.corrupt_entry(backend, self.key(2)):
            pytest.skip("this backend keeps no bytes to corrupt (corrupt_entry)")
        before = backend.stats()["corrupt_frames"]
        keys = [self.key(i) for i in (1, 2, 3)]
        objs = backend.batched_get_non_blocking("l", keys).result(timeout=60)
        try:
            assert len(objs) == 1 and torch.equal(objs[0].tensor, expected[0])
        finally:
            for obj in objs:
                obj.ref_down()
        assert backend.stats()["corrupt_frames"] == before + 1
        assert not backend.contains(self.key(2))

    def test_an_unreachable_tier_answers_misses_and_recovers(
            self, backend: StorageBackend) -> None:
        """Storage out of reach: gets are misses, puts are dropped and counted,
        nothing raises; once it is back the tier serves again by itself."""
        expected = self.put(backend, [1, 2])
        unreachable = self.make_unreachable(backend)
        if unreachable is None:
            pytest.skip("this kit cannot make the backend unreachable (make_unreachable)")
        before = backend.stats()
        with unreachable:
            assert backend.get_blocking(self.key(1)) is None
            keys = [self.key(1), self.key(2)]
            assert backend.batched_get_non_blocking("l", keys).result(timeout=60) == []
            backend.batched_async_contains("l", keys)  # answers, whatever it knows
            obj = self.make_obj(backend, 3)
            future = backend.batched_submit_put([self.key(3)], [obj])
            obj.ref_down()
            assert future.result(timeout=60) == 0
            backend.remove(self.key(9))
            during = backend.stats()
        assert during["errors"] > before["errors"], "a fault must be counted"
        assert during["dropped_writes"] >= before["dropped_writes"] + 1
        assert during["misses"] > before["misses"] and during["hits"] == before["hits"]
        assert _eventually(lambda: self._stores(backend, 4), self.recovery_deadline_s), \
            "the tier did not recover once its storage was back"
        self._check_reads(backend, 1, expected[0])

    def _stores(self, backend: StorageBackend, i: int) -> bool:
        obj = self.make_obj(backend, i)
        try:
            return backend.batched_submit_put([self.key(i)], [obj]).result(timeout=60) == 1
        finally:
            obj.ref_down()

    def _check_reads(self, backend: StorageBackend, i: int, expected: torch.Tensor) -> None:
        obj = backend.get_blocking(self.key(i))
        assert obj is not None, f"key {i} does not read back"
        try:
            assert torch.equal(obj.tensor, expected)
        finally:
            obj.ref_down()

    def test_an_entry_moved_to_another_key_is_a_miss(self, backend: StorageBackend) -> None:
        """A valid frame under another key's name is never served as that key's KV."""
        expected = self.put(backend, [4, 5])
        if not self.copy_entry(backend, self.key(4), self.key(5)):
            pytest.skip("this backend keeps no bytes to move")
        assert backend.get_blocking(self.key(5)) is None
        assert backend.stats()["corrupt_frames"] >= 1
        obj = backend.get_blocking(self.key(4))  # the original still reads as itself
        assert obj is not None and torch.equal(obj.tensor, expected[0])
        obj.ref_down()

    def test_a_tier_that_holds_memory_hands_out_buffers(self, backend: StorageBackend) -> None:
        """A tier that holds memory (``holds_memory_objs``) is where lmkv allocates
        every chunk buffer: ``allocate`` must give one of the shape and dtype asked."""
        if not backend.holds_memory_objs:
            pytest.skip("this tier stores bytes: lmkv allocates from the memory tier")
        obj = backend.allocate(self.chunk_shape, self.dtype)
        assert obj is not None, "a tier that holds memory must hand out chunk buffers"
        try:
            assert tuple(obj.shape) == self.chunk_shape and obj.dtype == self.dtype
        finally:
            obj.ref_down()

    def test_direct_chunks_read_what_was_stored(self, backend: StorageBackend) -> None:
        """A tier that leaves chunks in place for an engine to read into its own KV
        (``batched_get_direct``: ``DirectChunk``s, read from a descriptor or
        through a ``MappedFile``) hands chunks whose pieces, copied out one after
        another as an engine does, are the bytes stored, and which give their
        handles back when released. A tier that makes none is skipped."""
        expected = self.put(backend, [700, 701])
        future = backend.batched_get_direct("direct", [self.key(700), self.key(701)])
        if future is None:
            pytest.skip("this tier leaves no chunks in place (batched_get_direct is None)")
        got = future.result(timeout=30)
        try:
            assert len(got) == 2
            for obj, want in zip(got, expected, strict=True):
                if not isinstance(obj, DirectChunk):  # read in instead: a plain chunk
                    assert torch.equal(obj.tensor, want)
                    continue
                assert tuple(obj.shape) == tuple(want.shape) and obj.dtype == want.dtype
                out = torch.zeros_like(want)
                staging = torch.zeros(obj.layer_bytes, dtype=torch.uint8)
                for first, piece in obj.pieces(staging, obj.layer_bytes):  # a layer a piece
                    out[first:first + piece.shape[0]].copy_(piece)
                assert torch.equal(out, want)
        finally:
            release(got)

    def test_what_a_get_handed_over_stays_the_callers(self, backend: StorageBackend) -> None:
        """Each chunk a get hands over carries a reference of the caller's: once the
        caller releases it, the stored entry is intact, whatever is stored after
        (a tier that handed out its own reference would free a buffer it still
        stores, and the next allocation would overwrite it)."""
        expected = self.put(backend, [600, 601])
        keys = [self.key(600), self.key(601)]
        for _ in range(3):
            for obj in backend.batched_get_non_blocking("mine", keys).result(timeout=30):
                obj.ref_down()
            obj = backend.get_blocking(keys[0])
            assert obj is not None
            obj.ref_down()
        self.put(backend, list(range(610, 618)))
        for key, data in zip(keys, expected, strict=True):
            obj = backend.get_blocking(key)
            if obj is None:
                continue  # evicted to make room: a miss, never another chunk's bytes
            try:
                assert torch.equal(obj.tensor, data), \
                    "an entry changed after its readers released what they got"
            finally:
                obj.ref_down()

    def test_what_another_process_stored_outlives_it_and_reads_here(
            self, backend: StorageBackend, tmp_path: Path) -> None:
        check_read_across_processes(self, backend, tmp_path)

    def test_a_pinned_entry_survives_eviction_pressure(self, backend: StorageBackend) -> None:
        """Pins (``pin`` and ``batched_async_contains(pin=True)``) protect against
        eviction: a lookup's hits must still be there when it reads them."""
        if backend.capacity_bytes is None:
            bounded = self.make_bounded_backend(16 * self.chunk_bytes())
            if bounded is None:
                pytest.skip("this backend has no byte budget (make_bounded_backend)")
            backend.close()
            backend = bounded
        try:
            self._check_pins_survive(backend)
        finally:
            backend.close()

    def _check_pins_survive(self, backend: StorageBackend) -> None:
        capacity = backend.capacity_bytes
        assert capacity, "make_bounded_backend returned a backend without a budget"
        pressure = 3 * capacity // self.chunk_bytes() + 8
        if pressure > self.max_pressure_chunks:
            pytest.skip(f"a budget of {capacity} bytes needs {pressure} chunks of pressure; "
                        "make_backend or make_bounded_backend should give a smaller one")
        expected = self.put(backend, [0, 1])
        assert backend.pin(self.key(0))
        assert backend.batched_async_contains("pinned", [self.key(1)], pin=True) == 1
        first = 1000
        for start in range(first, first + pressure, 8):
            self.put(backend, list(range(start, start + 8)))
        survivors = sum(backend.contains(self.key(i)) for i in range(first, first + pressure))
        assert survivors < pressure, "no entry was evicted: the pressure test proves nothing"
        for i, data in enumerate(expected):
            assert backend.contains(self.key(i)), f"pinned key {i} was evicted"
            obj = backend.get_blocking(self.key(i))
            assert obj is not None and torch.equal(obj.tensor, data)
            obj.ref_down()
        assert backend.unpin(self.key(0)) and backend.unpin(self.key(1))

    # -- what lmkv does with the tier --------------------------------------------
    def test_the_class_passes_lmkvs_load_check(self) -> None:
        problem = load_problem(self._backend_class())
        assert not problem, f"lmkv would leave this tier out at load: {problem}"

    def chain(self, first: int, n: int) -> tuple[list[CacheKey], list[CacheKey | None]]:
        """``n`` consecutive chunks of one prompt: their keys and parents."""
        keys = [self.key(i) for i in range(first, first + n)]
        return keys, [None, *keys[:-1]]

    def put_chain(self, backend: StorageBackend, first: int, n: int) -> list[torch.Tensor]:
        keys, parents = self.chain(first, n)
        objs = [self.make_obj(backend, first + i) for i in range(n)]
        expected = [o.tensor.clone() for o in objs]
        stored = backend.batched_submit_put(keys, objs, parents=parents).result(timeout=60)
        release(objs)
        assert stored == n, f"stored {stored} of {n} chunks"
        return expected

    @pytest.mark.parametrize("eviction", BUILTIN_EVICTION_POLICIES)
    def test_each_builtin_eviction_policy_drives_the_tier(self, eviction: str) -> None:
        """Stores, reads and removes work whichever of lmkv's policies the config
        gives the tier (a tier that drives its policy otherwise than through
        ``insert`` / ``access`` / ``forget`` / ``candidates`` breaks here)."""
        backend = self.build_backend(eviction)
        before = backend.stats()
        expected = self.put_chain(backend, 700, 4)
        keys, _ = self.chain(700, 4)
        assert backend.batched_async_contains("policy", keys) == 4
        objs = backend.batched_get_non_blocking("policy", keys).result(timeout=60)
        try:
            assert len(objs) == 4
            for obj, data in zip(objs, expected, strict=True):
                assert torch.equal(obj.tensor, data)
        finally:
            release(objs)
        for key in reversed(keys):
            assert backend.remove(key)
        after = backend.stats()
        assert after["errors"] == before["errors"], f"errors with eviction {eviction!r}"
        assert after["dropped_writes"] == before["dropped_writes"]

    def test_the_tier_hands_its_policy_each_parent(self) -> None:
        """lmkv stores a prompt's chunks with their parents; a tier that evicts
        through its policy passes each on (``insert(key, parent)``), so the policy
        evicts tails first and no stored prefix loses its head."""
        ParentRecorder.seen.clear()
        backend = self.build_backend(ParentRecorder.name)
        self.put_chain(backend, 800, 4)
        keys, parents = self.chain(800, 4)
        seen = {k: ParentRecorder.seen[k] for k in keys if k in ParentRecorder.seen}
        if not seen:
            return  # a tier that never stores through its policy (it evicts by itself)
        assert seen == dict(zip(keys, parents, strict=True)), \
            "the tier did not hand its policy the parents it was given"

    def _managed(self) -> tuple[StorageManager, bool]:
        """A storage manager lmkv builds with the tier last, below a cpu tier unless
        it holds memory itself; and whether it is below one."""
        below = not self._backend_class().holds_memory_objs
        tiers = ([{"type": "cpu", "options": {"max_bytes": 64 * self.chunk_bytes()}}]
                 if below else [])
        storage = self.build_storage([*tiers, self._tier_ref()])
        storage.set_chunk_bytes(self.chunk_bytes())
        return storage, below

    def _stored_chain(self, storage: StorageManager, first: int, n: int
                      ) -> tuple[list[CacheKey], list[torch.Tensor]]:
        """A prompt of ``n`` chunks stored through ``storage`` (written through to
        its last tier): its keys and its chunks' contents."""
        keys, parents = self.chain(first, n)
        objs = [self.make_obj(storage.tiers[-1], first + i) for i in range(n)]
        expected = [o.tensor.clone() for o in objs]
        assert storage.put(keys, objs, parents).result(timeout=60) == n
        release(objs)
        assert storage.flush(60), "the write-through to the tier did not finish"
        return keys, expected

    def test_a_storage_manager_serves_the_tier(self) -> None:
        """The tier in a storage manager lmkv builds from a config: a store goes
        through (written through when the tier is below a memory tier), a lookup
        prefetches it back bit-exactly, a get and a stream read it, and a chunk the
        upper tier lost is read from this one and promoted."""
        storage, below = self._managed()
        tier = storage.tiers[-1]
        keys, expected = self._stored_chain(storage, 900, 4)
        assert tier.batched_async_contains("manager", keys) == 4
        if below:  # the memory tier loses the last two: they come from this tier
            for key in keys[2:]:
                assert storage.tiers[0].remove(key)
        ends = [(i + 1) * self.chunk_shape[2] for i in range(4)]
        assert storage.lookup_and_prefetch("m", keys, ends).result(timeout=60) == ends[-1]
        got = storage.take_prefetched("m", keys, timeout=60)
        assert got is not None
        try:
            assert len(got) == 4
            for obj, data in zip(got, expected, strict=True):
                assert torch.equal(obj.tensor, data)
        finally:
            release(got)
        for read in (storage.get(keys), [o for _, objs in storage.stream(keys) for o in objs]):
            try:
                assert [torch.equal(o.tensor, d) for o, d in zip(read, expected, strict=True)] \
                    == [True] * 4
            finally:
                release(read)
        if below:
            assert _eventually(lambda: storage.tiers[0].contains(keys[3]), 30), \
                "what the tier served was not promoted into the memory tier"
        assert storage.tiers[0].batched_async_contains("manager", keys) == 4

    def test_a_tier_below_a_memory_tier_is_handed_it(self) -> None:
        """API 2.3: a tier built below the tier that holds memory gets it as
        ``BackendContext.memory`` and leaves it working: closing this tier never
        closes the memory tier."""
        storage, below = self._managed()
        if not below:
            pytest.skip("this tier holds memory itself")
        tier = storage.tiers[-1]
        assert tier.context.memory is storage.tiers[0]
        keys, _ = self._stored_chain(storage, 950, 2)
        tier.close()
        assert storage.tiers[0].batched_async_contains("kit", keys) == 2

    def test_a_tier_that_looks_up_in_memory_is_asked_on_the_lookups_thread(self) -> None:
        """A tier that says ``lookups_in_memory`` (API 2.2) is asked on the thread
        that looks up, in a storage manager whose every tier says so: its
        ``batched_async_contains`` and the start of its gets run there, and the
        prefetch threads get only the waiting for reads still pending. Here they
        cannot run until the lookup has returned: a lookup still finds what was
        stored, bit-exactly, and one of keys the tier does not hold is answered
        before it returns, with nothing handed over. A tier that keeps the
        default (False) is skipped."""
        storage, below = self._managed()
        if not looks_up_in_memory(storage.tiers[-1]):
            pytest.skip("this tier does not say its lookups need no I/O (lookups_in_memory, "
                        "API 2.2)")
        keys, expected = self._stored_chain(storage, 960, 3)
        if below:  # the memory tier loses the last one: it comes from this tier
            assert storage.tiers[0].remove(keys[2])
        handed: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

        def hand(fn: Callable[..., Any], *args: Any) -> None:  # what it hands over, kept
            handed.append((fn, args))

        storage._executor.submit = hand  # type: ignore[method-assign, assignment]
        ends = [(i + 1) * self.chunk_shape[2] for i in range(3)]
        future = storage.lookup_and_prefetch("here", keys, ends)
        for fn, args in handed:  # the waiting it handed over, run now
            fn(*args)
        assert future.result(timeout=60) == ends[-1]
        got = storage.take_prefetched("here", keys, timeout=60)
        assert got is not None
        try:
            assert [torch.equal(o.tensor, d) for o, d in zip(got, expected, strict=True)] \
                == [True] * 3
        finally:
            release(got)
        handed.clear()
        missing = [self.key(990), self.key(991)]
        future = storage.lookup_and_prefetch("absent", missing, ends[:2])
        assert future.done() and future.result() == 0 and not handed, \
            "a lookup of keys no tier holds was handed to a prefetch thread"


def _eventually(condition: Callable[[], bool], deadline_s: float) -> bool:
    """Poll ``condition`` until it holds or ``deadline_s`` passes (a liveness bound)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True
