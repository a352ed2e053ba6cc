"""Synchronous reads (get, stream) without the prefetch machinery, and promotion
once a read is over."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey
from lmkv.storage.manager import StorageManager
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_backends.tiers.fs import FSBackend
from lmkv_policies.lru import LRUPolicy
from tests.storage.tiers import SHAPE, cpu, fill, key


def values(objs: list) -> list[int]:
    return [int(o.tensor.flatten()[0]) for o in objs]


def no_leaks(*tiers: CPUBackend) -> None:
    for tier in tiers:
        assert sum(pins for _, pins in tier.entry_refs()) == 0
        assert tier.allocator.live_objects == len(tier)


class Hung(CPUBackend):
    """Its gets answer only once ``gate`` is set (a stalled remote tier)."""

    name = "hung"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.waiting: list[threading.Thread] = []

    def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheKey]) -> Future:
        late: Future = Future()
        real = super().batched_get_non_blocking

        def answer() -> None:
            self.gate.wait(30)
            late.set_result(real(lookup_id, keys).result())

        self.waiting.append(threading.Thread(target=answer, daemon=True))
        self.waiting[-1].start()
        return late


def test_get_and_stream_read_on_the_callers_thread_past_busy_prefetches() -> None:
    """Every prefetch thread waits on a stalled lower tier: a get or a stream of
    chunks the upper tier holds answers at once, and leaves no prefetch behind."""
    upper, lower = cpu(), cpu(Hung)
    fill(upper, [0, 1])
    fill(lower, [5])
    manager = StorageManager([upper, lower], prefetch_threads=2)
    try:
        stalled = [manager.lookup_and_prefetch(f"s{i}", [key(5)], [1]) for i in range(3)]
        got: list[list[int]] = []

        def read() -> None:
            objs = manager.get([key(0), key(1)])
            got.append(values(objs))
            for obj in objs:
                obj.ref_down()
            for _, batch in manager.stream([key(0), key(1)]):
                got.append(values(batch))
                for obj in batch:
                    obj.ref_down()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "a synchronous read waited for the prefetch threads"
        assert got == [[0, 1], [0, 1]]
        assert len(manager.events) == 3  # the stalled lookups only
    finally:
        lower.gate.set()
        for future in stalled:
            future.result(10)
        for i in range(3):
            manager.release_prefetched(f"s{i}")
        manager.close()
    no_leaks(upper, lower)


class Recording(CPUBackend):
    """Records each put it is offered: (keys, parents)."""

    name = "recording"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.puts: list[tuple[list[CacheKey], list[CacheKey | None] | None]] = []

    def batched_submit_put(self, keys, objs, parents=None):  # type: ignore[no-untyped-def]
        self.puts.append((list(keys), None if parents is None else list(parents)))
        return super().batched_submit_put(keys, objs, parents)


@pytest.mark.parametrize("read", ["get", "stream", "prefetch"])
def test_lower_tier_chunks_are_promoted_once_after_the_read_with_their_chain(read: str
                                                                            ) -> None:
    """Chunks 0-1 from the middle tier, 2-3 from the bottom one: one put into the
    first tier once the read is over, each chunk's parent the one before it."""
    upper, middle, bottom = cpu(Recording), cpu(), cpu()
    fill(middle, [0, 1])
    fill(bottom, [2, 3])
    manager = StorageManager([upper, middle, bottom])
    keys = [key(i) for i in range(4)]
    try:
        if read == "get":
            objs = manager.get(keys)
        elif read == "prefetch":
            assert manager.lookup_and_prefetch("p", keys, [1, 2, 3, 4]).result(10) == 4
            objs = manager.take_prefetched("p", keys)
        else:
            objs = []
            for first, batch in manager.stream(keys):
                # Handed over before anything is promoted: no put waits in between.
                assert upper.puts == [] and not upper.contains(key(first))
                objs.extend(batch)
        assert values(objs) == [0, 1, 2, 3]
        for obj in objs:
            obj.ref_down()
        assert upper.puts == [(keys, [None, *keys[:3]])]
        assert all(upper.contains(k) for k in keys)
    finally:
        manager.close()
    no_leaks(upper, middle, bottom)


def test_a_caller_that_releases_each_batch_at_once_leaves_the_promotion_whole(
        tmp_path: Path) -> None:
    """The fs tier decodes into the cpu tier's arena; the stream's caller drops its
    references before the promotion is put: the promoted chunks are still the
    ones read (never a freed buffer someone else now holds), and nothing leaks."""
    upper = cpu()
    lower = FSBackend(FSBackend.Options(url=str(tmp_path)),
                      BackendContext(serializer=NaiveSerializer(), eviction_policy=LRUPolicy(),
                                     allocate=upper.allocate, tier_index=1))
    manager = StorageManager([upper, lower])
    keys = [key(i) for i in (3, 4, 5)]
    try:
        objs = []
        for i in (3, 4, 5):
            obj = upper.allocate(SHAPE, torch.float32)
            obj.tensor.fill_(i)
            objs.append(obj)
        lower.batched_submit_put(keys, objs).result(10)
        for obj in objs:
            obj.ref_down()
        for _, batch in manager.stream(keys):
            for obj in batch:
                obj.ref_down()
            # Whatever the arena hands out next must not be a promoted chunk's buffer.
            scratch = [upper.allocate(SHAPE, torch.float32) for _ in keys]
            for obj in scratch:
                obj.tensor.fill_(-1)
                obj.ref_down()
        objs = upper.batched_get_non_blocking("", keys).result()
        assert values(objs) == [3, 4, 5]
        for obj in objs:
            obj.ref_down()
    finally:
        manager.close()
    no_leaks(upper)


def test_a_stream_closed_early_still_promotes_what_it_read() -> None:
    upper, lower = cpu(), cpu()
    fill(lower, [0, 1])
    manager = StorageManager([upper, lower])
    try:
        stream = manager.stream([key(0), key(1)])
        _, batch = next(stream)
        for obj in batch:
            obj.ref_down()
        stream.close()
        assert upper.contains(key(0)) and upper.contains(key(1))
    finally:
        manager.close()
    no_leaks(upper, lower)


def test_a_chunk_dropped_during_a_read_is_not_promoted_back() -> None:
    """A reader that finds a chunk unusable drops it (``StorageManager.drop``) while
    its stream still holds it: the promotion at the stream's end leaves it and its
    tail out, and it is counted once, in the tier that held it. Stored again, it
    is promoted by later reads."""
    upper, lower = cpu(), cpu()
    fill(lower, [0, 1, 2])
    manager = StorageManager([upper, lower])
    try:
        stream = manager.stream([key(0), key(1), key(2)])
        _, batch = next(stream)
        manager.drop(key(1), "does not fit")
        for obj in batch:
            obj.ref_down()
        stream.close()
        assert upper.contains(key(0))
        assert not upper.contains(key(1)) and not upper.contains(key(2))
        assert not lower.contains(key(1)) and lower.stats()["corrupt_frames"] == 1
        assert upper.stats()["corrupt_frames"] == 0

        fill(lower, [1])
        obj = manager.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(1)
        manager.put([key(1)], [obj], [key(0)]).result()  # the right KV is back
        obj.ref_down()
        got = manager.get([key(0), key(1), key(2)])
        assert values(got) == [0, 1, 2]
        for o in got:
            o.ref_down()
        assert upper.contains(key(2))  # promoted again once key 1 was stored
    finally:
        manager.close()
    no_leaks(upper, lower)
