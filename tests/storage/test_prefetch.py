"""Tiered lookup and prefetch, write-through, promotion and the semaphore."""

from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from lmkv.contracts.tier import done_future
from lmkv.keys.chunking import CacheKey
from lmkv.storage.manager import StorageManager
from lmkv.storage.prefetch import EventManager, WeightedSemaphore
from lmkv_backends.tiers.cpu import CPUBackend
from tests.storage.tiers import NBYTES, SHAPE, cpu, fill, key


def values(objs) -> list[int]:
    return [int(o.tensor.flatten()[0]) for o in objs]


def pins(tier: CPUBackend) -> int:
    return sum(pins for _, pins in tier.entry_refs())


def no_leaks(*tiers: CPUBackend) -> None:
    for tier in tiers:
        assert pins(tier) == 0
        assert tier.allocator.live_objects == len(tier)


@pytest.fixture
def two_tiers():
    upper, lower = cpu(), cpu()
    manager = StorageManager([upper, lower])
    yield manager, upper, lower
    manager.close()


def test_prefix_spans_tiers_and_counts_tokens(two_tiers) -> None:
    manager, upper, lower = two_tiers
    fill(upper, [0, 1])
    fill(lower, [2, 3, 5])
    keys = [key(i) for i in range(6)]
    ends = [256 * (i + 1) for i in range(6)]
    assert manager.lookup_and_prefetch("a", keys, ends).result(5) == 1024
    objs = manager.take_prefetched("a")
    assert values(objs) == [0, 1, 2, 3]
    for obj in objs:
        obj.ref_down()
    no_leaks(upper, lower)


def test_lower_tier_hits_are_promoted(two_tiers) -> None:
    manager, upper, lower = two_tiers
    fill(lower, [0, 1, 2])
    objs = manager.get([key(i) for i in range(3)])
    assert values(objs) == [0, 1, 2]
    for obj in objs:
        obj.ref_down()
    assert all(upper.contains(key(i)) for i in range(3))
    no_leaks(upper, lower)


def test_whole_chunks_only_in_layerwise_mode(two_tiers) -> None:
    """keys_per_chunk=3: 7 stored keys are 2 whole chunks; the 7th is unpinned."""
    manager, upper, _ = two_tiers
    fill(upper, range(7))
    keys = [key(i) for i in range(9)]
    assert manager.lookup_and_prefetch("l", keys, [10, 20, 30], keys_per_chunk=3).result(5) == 20
    objs = manager.take_prefetched("l")
    assert values(objs) == list(range(6))
    for obj in objs:
        obj.ref_down()
    no_leaks(upper)


def test_full_miss_answers_zero(two_tiers) -> None:
    manager, _, _ = two_tiers
    assert manager.lookup_and_prefetch("m", [key(1)], [256]).result(5) == 0
    assert manager.take_prefetched("m") == []


class Forgetful(CPUBackend):
    """Evicts a key between the contains and the get (a race the manager must survive)."""

    name = "forgetful"
    forget: CacheKey | None = None

    def batched_get_non_blocking(self, lookup_id, keys):
        if self.forget is not None:
            self.unpin(self.forget)
            self.remove(self.forget)
        return super().batched_get_non_blocking(lookup_id, keys)


class Unpinnable(CPUBackend):
    """Evicts a key between the get of a lookup's chunks and their pins."""

    name = "unpinnable"
    forget: CacheKey | None = None

    def batched_async_contains(self, lookup_id, keys, pin=False):
        if self.forget is not None:
            self.remove(self.forget)
        return super().batched_async_contains(lookup_id, keys, pin)


def test_a_first_tier_whose_get_raises_is_a_miss_there_and_the_tiers_below_still_serve(
        caplog) -> None:
    class Broken(CPUBackend):
        name = "broken-get"

        def batched_get_non_blocking(self, lookup_id, keys):
            raise RuntimeError("a bug in the tier")

    upper, lower = cpu(Broken), cpu()
    manager = StorageManager([upper, lower])
    try:
        fill(upper, [0, 1])
        fill(lower, [0, 1])
        keys = [key(0), key(1)]
        assert manager.lookup_and_prefetch("b", keys, [1, 2]).result(5) == 2
        objs = manager.take_prefetched("b")
        assert values(objs) == [0, 1]
        for obj in objs:
            obj.ref_down()
        assert "get raised RuntimeError" in caplog.text
    finally:
        manager.close()
    no_leaks(lower)
    assert pins(upper) == 0


def test_a_memory_tier_whose_get_answers_later_is_not_waited_for_on_the_callers_thread(
        ) -> None:
    """A memory tier's get is read on the caller's thread only when it answered at
    once; one still pending is left to finish (its chunks given back) and the
    lookup goes on as for any tier: its hits pinned, the reads of a prompt it
    holds only part of handed to a prefetch thread."""
    gate = threading.Event()

    class Slow(CPUBackend):
        name = "slow-get"

        def batched_get_non_blocking(self, lookup_id, keys):
            future: Future = Future()
            answer = super().batched_get_non_blocking(lookup_id, keys).result()

            def later() -> None:
                gate.wait(10)
                future.set_result(answer)

            threading.Thread(target=later, daemon=True).start()
            return future

    upper, lower = cpu(Slow), cpu()
    manager = StorageManager([upper, lower])
    try:
        fill(upper, [0])
        fill(lower, [1])
        started = time.monotonic()
        future = manager.lookup_and_prefetch("p", [key(0), key(1)], [1, 2])
        assert time.monotonic() - started < 5 and not future.done()
        gate.set()
        assert future.result(10) == 2
        objs = manager.take_prefetched("p")
        assert values(objs) == [0, 1]
        for obj in objs:
            obj.ref_down()
        deadline = time.monotonic() + 10
        # Given back means every entry back to the tier's own reference, unpinned:
        # the get left pending holds references, not pins, until it answers.
        while (any(refs != (1, 0) for refs in upper.entry_refs())
               or upper.allocator.live_objects != len(upper)):
            assert time.monotonic() < deadline, "the first get's chunks were not given back"
            time.sleep(0.01)
    finally:
        gate.set()
        manager.close()
    no_leaks(upper, lower)


def test_an_alias_that_no_longer_resolves_ends_a_whole_memory_hit_with_its_longest_part(
        ) -> None:
    """The memory tier holds every key, but chunk 1 is an alias whose target went:
    the answer ends there, with the longest leading blocks of chunk 1 found, as
    for a lookup the tiers answer in part."""
    from lmkv.keys.aliases import make_alias
    from lmkv.storage.manager import Partials

    upper, lower = cpu(), cpu()
    manager = StorageManager([upper, lower])
    try:
        fill(upper, [0, 50])
        alias = make_alias(key(99), upper.allocate)  # names a chunk stored nowhere
        upper.batched_submit_put([key(1)], [alias]).result()
        alias.ref_down()
        partials = Partials([[], [key(50)]], 4)
        got = manager.lookup_and_prefetch("a", [key(0), key(1)], [8, 16], partials=partials)
        assert got.result(5) == 8 + 4
        objs = manager.take_prefetched("a", longer=True)
        assert values(objs) == [0, 50]
        for obj in objs:
            obj.ref_down()
    finally:
        manager.close()
    no_leaks(upper, lower)


def test_a_short_tier_ends_the_answer_and_releases_the_rest() -> None:
    upper, lower = cpu(), cpu(Forgetful)
    manager = StorageManager([upper, lower])
    fill(upper, [0])
    fill(lower, [1, 2, 3])
    lower.forget = key(2)
    keys = [key(i) for i in range(4)]
    assert manager.lookup_and_prefetch("s", keys, [1, 2, 3, 4]).result(5) == 2
    objs = manager.take_prefetched("s")
    assert values(objs) == [0, 1]
    for obj in objs:
        obj.ref_down()
    no_leaks(upper, lower)
    manager.close()


def test_an_entry_evicted_before_its_pin_ends_the_first_tiers_part() -> None:
    """The first tier (memory) is read at once; of a prompt it holds only part of,
    what it read is pinned for the plan. An entry evicted in between ends its
    part there: the chunks after it are given back, the rest is a miss."""
    upper, lower = cpu(Unpinnable), cpu()
    manager = StorageManager([upper, lower])
    fill(upper, [0, 1, 2])
    fill(lower, [3])
    upper.forget = key(1)
    keys = [key(i) for i in range(4)]
    assert manager.lookup_and_prefetch("u", keys, [1, 2, 3, 4]).result(5) == 1
    objs = manager.take_prefetched("u")
    assert values(objs) == [0]
    objs[0].ref_down()
    no_leaks(upper, lower)
    manager.close()


def test_cleanup_of_a_lookup_releases_every_pin_and_reference(two_tiers) -> None:
    manager, upper, lower = two_tiers
    fill(upper, [0])
    fill(lower, [1, 2])
    future = manager.lookup_and_prefetch("c", [key(i) for i in range(3)], [1, 2, 3])
    manager.release_prefetched("c")  # maybe before it finished
    future.result(5)
    assert manager.take_prefetched("c") is None
    no_leaks(upper, lower)


def test_take_waits_for_the_prefetch_and_unknown_ids_are_none(two_tiers) -> None:
    manager, upper, _ = two_tiers
    fill(upper, [0])
    manager.lookup_and_prefetch("w", [key(0)], [5])
    objs = manager.take_prefetched("w")
    assert values(objs) == [0]
    objs[0].ref_down()
    assert manager.take_prefetched("never-started") is None


def test_take_for_a_shorter_prompt_hands_over_its_chunks_and_releases_the_rest(
        two_tiers) -> None:
    manager, upper, lower = two_tiers
    fill(upper, [0, 1])
    fill(lower, [2])
    keys = [key(i) for i in range(3)]
    manager.lookup_and_prefetch("s", keys, [1, 2, 3]).result(5)
    objs = manager.take_prefetched("s", keys[:2])
    assert values(objs) == [0, 1]
    for obj in objs:
        obj.ref_down()
    no_leaks(upper, lower)
    # The same id prefetched for another prompt yields nothing, and leaks nothing.
    manager.lookup_and_prefetch("s", keys, [1, 2, 3]).result(5)
    assert manager.take_prefetched("s", [key(7), key(8)]) is None
    no_leaks(upper, lower)


def test_fall_through_whatever_the_order() -> None:
    a, b, c = cpu(), cpu(), cpu()
    fill(c, [0, 1])
    for order in ([a, b, c], [c, b, a], [b, c, a]):
        manager = StorageManager(order)
        assert manager.contains_prefix([key(0), key(1)]) == 2
        objs = manager.get([key(0), key(1)])
        assert values(objs) == [0, 1]
        for obj in objs:
            obj.ref_down()
        manager.flush()
        manager._writers.clear()  # tiers are shared between the managers here
        manager.events.close()


class Slow(CPUBackend):
    name = "slow"
    delay = 0.0
    release_event: threading.Event | None = None

    def batched_submit_put(self, keys, objs, parents=None):
        if self.release_event is not None:
            self.release_event.wait(10)
        return super().batched_submit_put(keys, objs)


def test_write_through_never_blocks_and_a_full_queue_drops() -> None:
    upper, lower = cpu(), cpu(Slow)
    lower.release_event = threading.Event()
    manager = StorageManager([upper, lower], write_queue_chunks=4)
    t0 = time.monotonic()
    for i in range(10):
        obj = manager.allocate(SHAPE, torch.float32)
        manager.put([key(i)], [obj])
        obj.ref_down()
    assert time.monotonic() - t0 < 5  # the stalled tier did not hold up the caller
    assert lower.counters.dropped_writes >= 5
    lower.release_event.set()
    assert manager.flush(10)
    stored = sum(lower.contains(key(i)) for i in range(10))
    assert stored == 10 - lower.counters.dropped_writes
    assert all(upper.contains(key(i)) for i in range(10))
    manager.close()
    no_leaks(upper, lower)


def test_a_lower_tier_that_falls_behind_gives_up_its_oldest_waiting_writes() -> None:
    """Chunks waiting for the write-through are held: the memory tier cannot evict
    them. When it needs the room, chunks whose writes wait are given up one at a
    time (counted as dropped), the oldest write first, and the new chunks are
    stored; not a chunk something else holds too, nor more than the room needs,
    nor the write being made."""
    upper, lower = cpu(max_bytes=8 * NBYTES), cpu(Slow)
    lower.release_event = threading.Event()
    manager = StorageManager([upper, lower])

    def store(ids: list[int]) -> int:
        objs = []
        for _ in ids:
            obj = manager.allocate(SHAPE, torch.float32)
            if obj is None:
                break
            objs.append(obj)
        if objs:
            manager.put([key(i) for i in ids[:len(objs)]], objs).result()
        for obj in objs:
            obj.ref_down()
        return len(objs)

    assert store([0, 1]) == 2  # taken by the writer, which the lower tier stalls
    deadline = time.monotonic() + 5
    while lower_queue(manager) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store([2, 3]) == 2 and store([4, 5]) == 2  # waiting in the queue
    assert lower.counters.dropped_writes == 0
    reader = upper.get_blocking(key(3))  # held by a reader too: giving it up frees nothing
    assert store([6, 7, 8]) == 3  # 2 free, then one chunk's write given up: 2's
    assert lower.counters.dropped_writes == 1
    assert not upper.contains(key(2)) and upper.contains(key(3))
    reader.ref_down()
    assert store([9]) == 1  # now 3's
    assert lower.counters.dropped_writes == 2
    assert not any(upper.contains(key(i)) for i in (2, 3))
    assert all(upper.contains(key(i)) for i in (0, 1, 4, 5, 6, 7, 8, 9))
    lower.release_event.set()
    assert manager.flush(10)
    assert [i for i in range(10) if lower.contains(key(i))] == [0, 1, 4, 5, 6, 7, 8, 9]
    manager.close()
    no_leaks(upper, lower)


def test_a_chunk_queued_for_two_lower_tiers_is_given_up_in_both() -> None:
    upper, disk, remote = cpu(max_bytes=4 * NBYTES), cpu(Slow), cpu(Slow)
    gate = disk.release_event = remote.release_event = threading.Event()
    manager = StorageManager([upper, disk, remote])
    for ids in ([0], [1, 2]):
        objs = [manager.allocate(SHAPE, torch.float32) for _ in ids]
        manager.put([key(i) for i in ids], objs).result()
        for obj in objs:
            obj.ref_down()
        deadline = time.monotonic() + 5  # both writers take [0] (stalled); [1, 2] waits
        while ids == [0] and any(w.oldest_queued is not None for w in manager._writers):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    obj = manager.allocate(SHAPE, torch.float32)  # one free, then 2 given up in both
    other = manager.allocate(SHAPE, torch.float32)
    assert obj is not None and other is not None
    assert disk.counters.dropped_writes == remote.counters.dropped_writes == 1
    assert not upper.contains(key(2)) and upper.contains(key(1))
    for held in (obj, other):
        held.ref_down()
    gate.set()
    assert manager.flush(10)
    assert [i for i in range(3) if disk.contains(key(i))] == [0, 1]
    assert [i for i in range(3) if remote.contains(key(i))] == [0, 1]
    manager.close()
    no_leaks(upper, disk, remote)


def test_a_write_being_made_is_never_given_up() -> None:
    upper, lower = cpu(max_bytes=4 * NBYTES), cpu(Slow)
    lower.release_event = threading.Event()
    manager = StorageManager([upper, lower])
    objs = [manager.allocate(SHAPE, torch.float32) for _ in range(4)]
    manager.put([key(i) for i in range(4)], objs).result()
    for obj in objs:
        obj.ref_down()
    deadline = time.monotonic() + 5
    while lower_queue(manager) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.allocate(SHAPE, torch.float32) is None  # held by the write being made
    assert lower.counters.dropped_writes == 0
    lower.release_event.set()
    assert manager.flush(10)
    obj = manager.allocate(SHAPE, torch.float32)
    assert obj is not None
    obj.ref_down()
    manager.close()
    no_leaks(upper, lower)


def lower_queue(manager: StorageManager) -> bool:
    """Whether a write waits in the first lower tier's queue (not taken by its writer)."""
    return manager._writers[0].oldest_queued is not None


def test_close_returns_promptly_with_a_hung_lower_tier() -> None:
    upper, lower = cpu(), cpu(Slow)
    lower.release_event = threading.Event()  # never set: the tier hangs
    manager = StorageManager([upper, lower])
    obj = manager.allocate(SHAPE, torch.float32)
    manager.put([key(1)], [obj])
    manager.put([key(2)], [obj])
    obj.ref_down()
    t0 = time.monotonic()
    manager.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    lower.release_event.set()


def test_semaphore_budget() -> None:
    sem = WeightedSemaphore(4)
    assert sem.acquire(3) == 3
    assert sem.acquire(2, timeout=0.05) == 0  # would exceed the budget
    assert sem.acquire(1) == 1
    sem.release(4)
    assert sem.acquire(10) == 4  # larger than the budget: takes all of it once idle
    got = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire(1)))
    waiter.start()
    time.sleep(0.05)
    assert got == []
    sem.release(4)
    waiter.join(2)
    assert got == [1]


def test_semaphore_is_sized_from_the_memory_tier(two_tiers) -> None:
    manager, upper, _ = two_tiers
    manager.set_chunk_bytes(NBYTES)
    assert manager._semaphore.budget == upper.capacity_bytes // NBYTES // 2
    fill(upper, range(4))
    objs = manager.get([key(i) for i in range(4)])
    assert manager._semaphore.used == 0
    for obj in objs:
        obj.ref_down()


def test_event_manager_reused_id_drops_the_stale_result() -> None:
    events = EventManager()
    tier = cpu()
    obj = tier.allocate(SHAPE, torch.float32)
    first = events.start("x")
    events.finish(first, [obj], 1)
    events.start("x")
    assert tier.allocator.live_objects == 0


def test_stream_yields_tier_by_tier_and_cleans_up_when_abandoned(two_tiers) -> None:
    manager, upper, lower = two_tiers
    fill(upper, [0, 1])
    fill(lower, [2, 3])
    keys = [key(i) for i in range(5)]
    batches = []
    for first, objs in manager.stream(keys):
        batches.append((first, values(objs)))
        for obj in objs:
            obj.ref_down()
    assert batches == [(0, [0, 1]), (2, [2, 3])]
    stream = manager.stream(keys)
    first, objs = next(stream)  # take the first tier's chunks, then walk away
    for obj in objs:
        obj.ref_down()
    stream.close()
    no_leaks(upper, lower)


def test_unclaimed_prefetches_expire_on_a_timer_while_idle() -> None:
    tier = cpu()
    manager = StorageManager([tier])
    manager.events.unclaimed_ttl_s = 0.05
    fill(tier, [0])
    manager.lookup_and_prefetch("forgotten", [key(0)], [1]).result(5)
    assert len(manager.events) == 1  # held for a retrieve that never comes
    # No further lookup: the timer alone gives the memory back.
    deadline = time.monotonic() + 15
    while len(manager.events) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(manager.events) == 0 and manager.events.expired == 1
    assert len(tier) == 1 and tier.entry_refs() == [(1, 0)]
    manager.close()


def test_a_finished_prefetch_keeps_only_the_keys_of_its_chunks() -> None:
    tier = cpu()
    manager = StorageManager([tier])
    fill(tier, [0])
    keys = [key(0), *(key(i) for i in range(100, 1100))]  # one hit, then 1000 misses
    manager.lookup_and_prefetch("long", keys, range(1, len(keys) + 1)).result(5)
    assert manager.events._tasks["long"].keys == (key(0),)
    manager.release_prefetched("long")
    no_leaks(tier)
    manager.close()


def test_semaphore_counts_chunks_in_layerwise_mode(two_tiers) -> None:
    manager, upper, _ = two_tiers
    manager._semaphore = WeightedSemaphore(3)
    held = manager._semaphore.acquire(1)  # another prefetch holds part of the budget
    fill(upper, range(6))
    keys = [key(i) for i in range(6)]
    # 6 keys are 2 chunks of 3 layers: 2 <= 3 - 1, so it runs now (counting 6 keys
    # would exceed the budget and wait until the semaphore is idle)
    assert manager.lookup_and_prefetch("l", keys, [1, 2], keys_per_chunk=3).result(5) == 2
    for obj in manager.take_prefetched("l"):
        obj.ref_down()
    manager._semaphore.release(held)
    assert manager._semaphore.used == 0


class Gated(CPUBackend):
    """A lower tier whose gets wait for ``gate`` (a slow disk or network)."""

    name = "gated"
    gate: threading.Event | None = None
    lookups_in_memory = False  # its gets wait: lookups over it go to a prefetch thread

    def batched_get_non_blocking(self, lookup_id, keys):
        if self.gate is not None:
            self.gate.wait(10)
        return super().batched_get_non_blocking(lookup_id, keys)


def test_a_lookup_the_memory_tier_answers_whole_is_answered_on_the_callers_thread() -> None:
    upper, lower = cpu(), cpu(Gated)
    lower.gate = threading.Event()
    manager = StorageManager([upper, lower])
    manager.set_chunk_bytes(NBYTES)
    try:
        fill(upper, [0, 1, 2])
        fill(lower, [3])
        keys = [key(i) for i in range(3)]
        ends = [256, 512, 768]
        threads = []
        manager._executor.submit = lambda *a, **k: threads.append(a)  # type: ignore[method-assign]
        future = manager.lookup_and_prefetch("mem", keys, ends)
        assert future.done() and future.result() == 768 and not threads
        assert manager._semaphore.used == 0  # memory reads allocate nothing: not counted
        objs = manager.take_prefetched("mem", keys)
        assert values(objs) == [0, 1, 2]
        for obj in objs:
            obj.ref_down()
        # one key only the slow tier holds: the lookup goes to the prefetch threads,
        # and the caller is not held up by the tier
        del manager._executor.submit
        future = manager.lookup_and_prefetch("both", [*keys, key(3)], [*ends, 1024])
        time.sleep(0.05)
        assert not future.done()
        lower.gate.set()
        assert future.result(5) == 1024
        objs = manager.take_prefetched("both")
        assert values(objs) == [0, 1, 2, 3]
        for obj in objs:
            obj.ref_down()
        # a partial memory hit with nothing below goes to the threads too, and answers
        assert manager.lookup_and_prefetch("miss", [key(0), key(9)], [256, 512]).result(5) == 256
        manager.release_prefetched("miss")
    finally:
        lower.gate.set()
        manager.close()
    no_leaks(upper, lower)


def test_the_memory_tier_is_read_once_a_lookup_whatever_it_holds() -> None:
    """One get of the whole prompt; only a part it holds is pinned after (the
    plan's, while the tiers below are read): never asked key by key or again."""
    class Counting(CPUBackend):
        name = "counting"
        asked: list[str] = []

        def batched_async_contains(self, lookup_id, keys, pin=False):
            self.asked.append("contains")
            return super().batched_async_contains(lookup_id, keys, pin=pin)

        def batched_get_non_blocking(self, lookup_id, keys):
            self.asked.append("get")
            return super().batched_get_non_blocking(lookup_id, keys)

    upper, lower = cpu(Counting), cpu()
    manager = StorageManager([upper, lower])
    try:
        fill(upper, [0])
        fill(lower, [1])
        upper.asked = []
        for lookup_id, ids, hit, asked in (("whole", [0], 256, ["get"]),
                                           ("part", [0, 1], 512, ["get", "contains"]),
                                           ("none", [7], 0, ["get"])):
            upper.asked.clear()
            keys = [key(i) for i in ids]
            ends = [256 * (i + 1) for i in range(len(ids))]
            assert manager.lookup_and_prefetch(lookup_id, keys, ends).result(5) == hit
            assert upper.asked == asked, lookup_id
            manager.release_prefetched(lookup_id)
    finally:
        manager.close()
    no_leaks(upper, lower)


def hand_offs(manager: StorageManager) -> list[str]:
    """The names of what ``manager`` hands its prefetch threads from now on."""
    handed: list[str] = []
    real = manager._executor.submit

    def spy(fn, *args):  # type: ignore[no-untyped-def]
        handed.append(fn.__name__)
        return real(fn, *args)

    manager._executor.submit = spy  # type: ignore[method-assign]
    return handed


class Later(CPUBackend):
    """A lower tier that looks up in memory (API 2.2) and answers its gets when
    ``answer`` is set, on a thread of its own (a disk's I/O threads)."""

    name = "later"
    api_version = "2.2"
    answer: threading.Event | None = None

    def batched_get_non_blocking(self, lookup_id, keys):
        out: Future = Future()

        def run() -> None:
            assert self.answer is not None
            self.answer.wait(10)
            out.set_result(super(Later, self).batched_get_non_blocking(lookup_id, keys)
                           .result())

        threading.Thread(target=run, daemon=True).start()
        return out


def test_a_lookup_over_tiers_that_look_up_in_memory_starts_on_the_callers_thread() -> None:
    """The plan and the gets start on the caller's thread; a get still pending
    is waited for on a prefetch thread; a lookup with its reads all done ends on
    the caller's thread with nothing handed over."""
    upper, lower = cpu(), cpu(Later)
    lower.answer = threading.Event()
    manager = StorageManager([upper, lower])
    manager.set_chunk_bytes(NBYTES)
    try:
        fill(upper, [0, 1])
        fill(lower, [2])
        keys, ends = [key(0), key(1), key(2)], [256, 512, 768]
        handed = hand_offs(manager)
        future = manager.lookup_and_prefetch("later", keys, ends)
        assert pins(lower) == 1  # planned, pinned and asked here
        assert handed == ["_end_handed"] and not future.done()
        lower.answer.set()
        assert future.result(5) == 768
        objs = manager.take_prefetched("later", keys)
        assert values(objs) == [0, 1, 2]
        for obj in objs:
            obj.ref_down()
        no_leaks(upper, lower)
    finally:
        manager.close()
    upper, plain = cpu(), cpu()  # the cpu tier's gets are done at once: it all ends here
    fill(upper, [0, 1])
    fill(plain, [2])
    manager = StorageManager([upper, plain])
    manager.set_chunk_bytes(NBYTES)
    try:
        handed = hand_offs(manager)
        future = manager.lookup_and_prefetch("here", keys, ends)
        assert future.done() and future.result() == 768 and not handed
        for obj in manager.take_prefetched("here", keys):
            obj.ref_down()
        no_leaks(upper, plain)
    finally:
        manager.close()


def test_a_lookup_handed_over_and_never_run_gives_back_what_it_holds_at_close() -> None:
    upper, lower = cpu(), cpu(Later)
    lower.answer = threading.Event()
    manager = StorageManager([upper, lower], prefetch_threads=1)
    manager.set_chunk_bytes(NBYTES)
    fill(upper, [0])
    fill(lower, [1, 2])
    busy = threading.Event()
    manager._executor.submit(busy.wait, 10)  # the one prefetch thread: held
    future = manager.lookup_and_prefetch("never", [key(0), key(1), key(2)], [256, 512, 768])
    assert pins(lower) == 2 and manager._semaphore.used == 3
    (args,) = manager._handed.values()
    lower.answer.set()  # its read is done, and holds two of the tier's buffers
    args[-1].futures[1].result(5)
    manager.close()  # the queued end is cancelled: what it holds goes back
    busy.set()
    assert future.result(1) == 0
    assert pins(upper) == pins(lower) == 0 and manager._semaphore.used == 0
    assert lower.allocator.live_objects == 0, "the read's buffers were not released"


class Short(CPUBackend):
    """A 2.2 tier whose gets return one chunk fewer than asked (one evicted
    between the lookup's contains and its get)."""

    name = "short"
    api_version = "2.2"

    def batched_get_non_blocking(self, lookup_id, keys):
        got = super().batched_get_non_blocking(lookup_id, keys).result()
        for obj in got[len(keys) - 1:]:
            obj.ref_down()
        return done_future(got[:len(keys) - 1])


def test_a_lookup_whose_reads_came_back_short_ends_on_a_prefetch_thread() -> None:
    """The reads are done at once but one came back short: what is left may read
    (block-granular hits): it is handed to a prefetch thread, not ended on the
    caller's."""
    upper, lower = cpu(), cpu(Short)
    manager = StorageManager([upper, lower])
    manager.set_chunk_bytes(NBYTES)
    try:
        fill(upper, [0])
        fill(lower, [1, 2])
        handed = hand_offs(manager)
        keys = [key(0), key(1), key(2)]
        future = manager.lookup_and_prefetch("short", keys, [256, 512, 768])
        assert future.result(5) == 512 and handed == ["_end_handed"]
        objs = manager.take_prefetched("short", keys)
        assert values(objs) == [0, 1]
        for obj in objs:
            obj.ref_down()
        no_leaks(upper, lower)
    finally:
        manager.close()


def test_a_tier_written_for_an_earlier_api_does_not_inherit_lookups_in_memory() -> None:
    """A subclass of the cpu tier written for 2.1 (or declaring nothing) keeps its
    lookups on the prefetch threads; one written for 2.2 inherits the cpu tier's
    ``lookups_in_memory``."""
    from lmkv.storage.manager import looks_up_in_memory

    class Old(CPUBackend):
        name = "old-cpu"
        api_version = "2.1"

    class Undeclared(CPUBackend):
        name = "undeclared-cpu"

    class New(CPUBackend):
        name = "new-cpu"
        api_version = "2.2"

    tiers = [cpu(Old), cpu(Undeclared), cpu(New), cpu()]
    try:
        assert [looks_up_in_memory(t) for t in tiers] == [False, False, True, True]
        assert not StorageManager([tiers[3], tiers[0]])._looks_up_here
        assert StorageManager([tiers[3], tiers[2]])._looks_up_here
    finally:
        for tier in tiers:
            tier.close()


def test_a_read_into_memory_gives_up_waiting_writes_as_a_store_does(tmp_path) -> None:
    """A lower tier reads into buffers of the memory tier: while writes hold every
    chunk there, the read makes room the way a store does (the storage manager
    takes over the ``allocate`` the tiers were built with)."""
    from lmkv import load_config

    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": 4 * NBYTES}},
        {"type": "fs", "options": {"url": str(tmp_path)}}]})
    manager = StorageManager.from_config(config)
    upper, disk = manager.tiers

    def store(i: int) -> None:
        obj = manager.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        manager.put([key(i)], [obj]).result()
        obj.ref_down()

    gate = threading.Event()
    try:
        store(100)
        assert manager.flush(10) and disk.contains(key(100))
        assert upper.remove(key(100))
        put = disk.batched_submit_put

        def stalled(keys, objs, parents=None):  # type: ignore[no-untyped-def]
            gate.wait(10)
            return put(keys, objs, parents=parents)

        disk.batched_submit_put = stalled  # type: ignore[method-assign]
        for i in range(4):  # the writer takes 0 (stalled), 1-3 wait: the arena is held
            store(i)
        deadline = time.monotonic() + 5
        while len(manager._writers[0]._queue) != 3:  # (0 taken by the writer)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = manager.get([key(100)])
        assert len(got) == 1 and bool((got[0].tensor == 100).all())
        got[0].ref_down()
        assert disk.counters.dropped_writes == 1  # the write of 1, the oldest waiting
        gate.set()
        assert manager.flush(10)
        assert [i for i in range(4) if disk.contains(key(i))] == [0, 2, 3]
    finally:
        gate.set()
        manager.close()


def test_the_expiry_thread_starts_with_the_manager_and_stops_with_it() -> None:
    """Not on a request's path: a thread's start waits until it runs."""
    manager = StorageManager([cpu()])
    reaper = manager.events._reaper
    assert reaper.is_alive()
    manager.close()
    assert not reaper.is_alive()


def test_a_manager_nobody_closed_takes_its_expiry_thread_with_it() -> None:
    events = EventManager()
    reaper = events._reaper
    del events
    gc.collect()
    reaper.join(5)
    assert not reaper.is_alive()


def test_a_forked_child_expires_with_a_thread_of_its_own() -> None:
    """A child forked after the manager was made: the parent's thread is not
    there; the child's first lookup starts one, which expires what is unclaimed."""
    tier = cpu()
    manager = StorageManager([tier])
    manager.events.unclaimed_ttl_s = 0.05
    fill(tier, [0])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once
        try:
            manager.lookup_and_prefetch("forgotten", [key(0)], [1]).result(5)
            deadline = time.monotonic() + 10
            while len(manager.events) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.write(write, b"1" if len(manager.events) == 0 else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        manager.close()
