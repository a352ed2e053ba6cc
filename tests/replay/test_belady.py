"""Belady's optimum and the textbook LRU, on cases checked by hand and on random traces."""

from __future__ import annotations

import random

import pytest

from lmkv.replay.belady import NEVER, belady_hits, lru_hits, next_uses


def test_next_uses_number_every_chunk_access_in_request_order() -> None:
    # accesses: 0:a 1:b | 2:c | 3:a 4:b
    assert next_uses([[10, 11], [12], [10, 11]]) == [[3, 4], [NEVER], [NEVER, NEVER]]


def test_belady_keeps_the_chunk_asked_for_again_soonest() -> None:
    # One slot: chunk 1 is never asked again, so the optimum does not let it in.
    assert belady_hits([[0], [1], [0]], 1) == 1
    assert lru_hits([[0], [1], [0]], 1) == 0


def test_belady_on_a_textbook_sequence() -> None:
    # 0 1 2 0 1 3 0 with two slots: miss 0, miss 1, 2 bypassed (never again),
    # hit 0, hit 1, 3 bypassed, hit 0.
    requests = [[c] for c in (0, 1, 2, 0, 1, 3, 0)]
    assert belady_hits(requests, 2) == 3
    # LRU: 2 evicts 0, 0 evicts 1, 1 evicts 2, 3 evicts 0: no hit at all.
    assert lru_hits(requests, 2) == 0


def test_belady_evicts_the_furthest_next_use() -> None:
    # Three slots hold 0, 1, 2; 3 must push one out: 2 (next use furthest) goes.
    requests = [[0], [1], [2], [3], [0], [1], [3], [2]]
    assert belady_hits(requests, 3) == 3  # 0, 1, 3 hit; 2 misses
    assert belady_hits(requests, 4) == 4


def test_hits_count_as_a_strict_prefix() -> None:
    # Two slots. The optimum keeps 0 and 1 (asked again) and lets 2 pass: 2 hits.
    # LRU evicts 0 for 2; then [0, 1] misses at 0, and the stored 1 behind it
    # counts for nothing.
    requests = [[0, 1], [2], [0, 1]]
    assert belady_hits(requests, 2) == 2
    assert lru_hits(requests, 2) == 0


def test_a_chunk_behind_the_first_miss_is_not_touched() -> None:
    # [5, 1] misses at 5: 1 is stored but not a hit and not made recent, so it
    # is the one LRU evicts when 6 arrives; 0 stays.
    requests = [[0, 1], [0], [5, 1], [6], [0, 1]]
    assert lru_hits(requests, 3) == 1 + 1  # [0] hits; the last [0, 1] hits 0 only


def test_capacity_under_one_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one chunk"):
        belady_hits([[0]], 0)
    with pytest.raises(ValueError, match="at least one chunk"):
        lru_hits([[0]], 0)


def _random_prefix_trace(rng: random.Random, requests: int) -> list[list[int]]:
    """Prompts that share prefixes: each picks a stem from a few and extends it."""
    stems = [[rng.randrange(1000) for _ in range(rng.randint(1, 4))] for _ in range(6)]
    trace = []
    for _ in range(requests):
        tail = [rng.randrange(40) for _ in range(rng.randint(0, 4))]
        trace.append(rng.choice(stems) + tail)
    # chunk ids as prefix keys: a chunk is named by its whole prefix
    ids: dict[tuple[int, ...], int] = {}
    return [[ids.setdefault(tuple(r[:i + 1]), len(ids)) for i in range(len(r))]
            for r in trace]


@pytest.mark.parametrize("seed", range(40))
def test_belady_is_never_below_lru(seed: int) -> None:
    rng = random.Random(seed)
    requests = _random_prefix_trace(rng, 60)
    unique = len({c for r in requests for c in r})
    for capacity in (1, 2, 3, 5, 8, 13, unique):
        assert belady_hits(requests, capacity) >= lru_hits(requests, capacity), capacity


def test_with_room_for_everything_only_first_sightings_miss() -> None:
    requests = _random_prefix_trace(random.Random(7), 80)
    total = sum(len(r) for r in requests)
    unique = len({c for r in requests for c in r})
    assert belady_hits(requests, unique) == lru_hits(requests, unique) == total - unique
