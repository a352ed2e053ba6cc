"""``lmkv.contracts.prefix_gets``: a remote tier's gets, window by window (the
redis and mooncake tiers run them against real servers in their own suites)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from lmkv.contracts import (
    CacheKey,
    KeyMeta,
    MemoryAllocator,
    MemoryObj,
    PrefixGets,
    TierCounters,
    TierFaults,
    TierUnavailable,
    read_windows,
)

META = KeyMeta("prefix-gets-test", 1, 0, "float32", "l2thd")


def keys(n: int) -> list[CacheKey]:
    return [CacheKey(META, i.to_bytes(4, "little") * 8) for i in range(n)]


@pytest.fixture
def arena() -> MemoryAllocator:
    return MemoryAllocator(1 << 20, pin_memory=False)


@pytest.fixture
def gets() -> PrefixGets:
    gets = PrefixGets(TierFaults(TierCounters(), "test tier"), 2, "test-get")
    yield gets
    gets.close()


def reader(arena: MemoryAllocator, found: int, then: BaseException | None = None):
    """A read that decodes the first ``found`` keys, then raises ``then`` (if any)."""
    def read(wanted: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        for _ in wanted[:found]:
            obj = arena.allocate((4,), torch.float32)
            assert obj is not None
            out.append(obj)
        if then is not None:
            raise then
    return read


def test_a_get_answers_the_prefix_and_counts_once(gets: PrefixGets,
                                                  arena: MemoryAllocator) -> None:
    objs = gets.read_prefix(keys(4), reader(arena, 2))
    assert len(objs) == 2
    assert (gets.counters.hits, gets.counters.misses) == (2, 1)
    for obj in objs:
        obj.ref_down()
    objs = gets.submit(keys(3), reader(arena, 3)).result(10)
    assert len(objs) == 3 and (gets.counters.hits, gets.counters.misses) == (5, 1)
    for obj in objs:
        obj.ref_down()


def test_a_fault_answers_what_was_decoded_and_is_counted(gets: PrefixGets,
                                                         arena: MemoryAllocator) -> None:
    objs = gets.read_prefix(keys(4), reader(arena, 1, TierUnavailable("gone")))
    assert len(objs) == 1, "the chunk decoded before the fault is still a hit"
    assert gets.counters.errors == 1 and gets.faults.breaker.is_open
    objs[0].ref_down()


def test_a_bug_gives_every_buffer_back_and_raises(gets: PrefixGets,
                                                  arena: MemoryAllocator) -> None:
    with pytest.raises(KeyError):
        gets.read_prefix(keys(4), reader(arena, 3, KeyError("a bug")))
    assert arena.used_bytes == 0
    assert gets.counters.errors == 0 and gets.counters.hits == 0


def test_no_keys_and_a_closed_tier_answer_at_once(gets: PrefixGets,
                                                  arena: MemoryAllocator) -> None:
    assert gets.submit([], reader(arena, 1)).result(0) == []
    assert gets.run(lambda: 7).result(10) == 7
    gets.close()
    assert gets.submit(keys(2), reader(arena, 2)).result(0) == []
    assert gets.run(lambda: 7) is None


def test_windows_are_sized_before_each_and_stop_where_take_says() -> None:
    sizes = iter([1, 2, 3, 100])
    fetched: list[list[int]] = []

    def take(window: Sequence[int], got: list[int]) -> bool:
        return 5 not in got

    read_windows(list(range(10)), lambda: next(sizes),
                 lambda window: fetched.append(list(window)) or list(window), take)
    assert fetched == [[0], [1, 2], [3, 4, 5]]


def test_the_next_window_moves_while_this_one_is_taken_and_is_given_back() -> None:
    started = threading.Event()
    released: list[list[int]] = []
    taken: list[list[int]] = []
    with ThreadPoolExecutor(1) as pool:
        def fetch(window: Sequence[int]) -> list[int]:
            if window[0] == 2:
                started.set()
            return list(window)

        def take(window: Sequence[int], got: list[int]) -> bool:
            taken.append(got)
            # The next window was asked for before this one is checked.
            assert got[0] != 0 or started.wait(10)
            return got[0] != 0

        def ahead(window: Sequence[int]) -> Future:
            return pool.submit(fetch, window)

        read_windows(list(range(6)), lambda: 2, fetch, take, ahead=ahead,
                     release=released.append)
    assert taken == [[0, 1]]
    assert released == [[2, 3]], "the window fetched past the stop is given back"


def test_a_failure_while_taking_still_gives_the_next_window_back() -> None:
    released: list[list[int]] = []
    with ThreadPoolExecutor(1) as pool:
        def take(window: Sequence[int], got: list[int]) -> bool:
            raise OSError("lost")

        with pytest.raises(OSError):
            read_windows([1, 2], lambda: 1, list, take,
                         ahead=lambda window: pool.submit(list, window),
                         release=released.append)
    assert released == [[2]]


def test_a_taken_window_is_let_go_before_the_next_is_fetched() -> None:
    """A fetch that holds its client's buffers (Mooncake's handles) must find the
    previous window's given back, or two windows' worth must fit."""
    alive: set[int] = set()

    class Handles:
        def __init__(self, first: int) -> None:
            self.first = first
            alive.add(first)

        def __del__(self) -> None:
            alive.discard(self.first)

    def fetch(window: Sequence[int]) -> Handles:
        assert alive == set(), f"windows still held: {alive}"
        return Handles(window[0])

    read_windows(list(range(4)), lambda: 1, fetch, lambda window, handles: True)
    assert alive == set()
