"""``lru`` ordering a tier's slots (arrays) orders exactly as it does by key."""

from __future__ import annotations

import random

import pytest

from lmkv.contracts.policy import EvictionPolicy, SlotLineage
from lmkv_policies.lru import LRUPolicy


def _twins() -> tuple[LRUPolicy, LRUPolicy]:
    by_key, by_slot = LRUPolicy(), LRUPolicy()
    by_slot.order_slots(lambda slot: f"k{slot}")
    assert isinstance(by_slot.lineage, SlotLineage)
    return by_key, by_slot


def _same(by_key: LRUPolicy, by_slot: LRUPolicy) -> None:
    assert [int(k[1:]) for k in by_key.candidates()] == list(by_slot.candidates())
    assert len(by_key) == len(by_slot) and len(by_key.lineage) == len(by_slot.lineage)


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_order_alike(seed: int) -> None:
    """Chains stored head first and tail first, reads, evictions of candidates and
    removals of inner keys: after each step both give the same candidates."""
    rng = random.Random(seed)
    by_key, by_slot = _twins()
    stored: set[int] = set()
    for _ in range(600):
        op = rng.random()
        if op < 0.45:  # store a short chain, in order or tail first
            start, length = rng.randrange(200), rng.randrange(1, 6)
            chain = list(range(start, min(start + length, 200)))
            pairs = [(k, k - 1 if k > start or rng.random() < 0.5 else None) for k in chain]
            if rng.random() < 0.3:
                pairs.reverse()
            for key, parent in pairs:
                if key in stored:
                    continue
                parent = None if parent is None or parent < 0 else parent
                by_key.insert(f"k{key}", None if parent is None else f"k{parent}")
                by_slot.insert(key, parent)
                stored.add(key)
        elif op < 0.7 and stored:  # read
            key = rng.choice(sorted(stored))
            by_key.access(f"k{key}")
            by_slot.access(key)
        elif op < 0.9 and stored:  # evict the first candidate
            victim = next(iter(by_slot.candidates()), None)
            if victim is None:
                continue
            by_key.forget(f"k{victim}")
            by_slot.forget(victim)
            stored.discard(victim)
        elif stored:  # remove any stored key (an inner one leaves a parked parent)
            key = rng.choice(sorted(stored))
            by_key.forget(f"k{key}")
            by_slot.forget(key)
            stored.discard(key)
        _same(by_key, by_slot)


def test_the_watcher_hears_keys_not_slots() -> None:
    _, by_slot = _twins()
    heard: list[tuple[object, bool]] = []
    by_slot.watch(lambda key, stored: heard.append((key, stored)))
    by_slot.insert(3, None)
    by_slot.insert(4, 3)
    by_slot.forget(4)
    assert heard == [("k3", True), ("k4", True), ("k4", False)]


def test_a_policy_that_does_not_order_slots_says_so() -> None:
    class Plain(EvictionPolicy):
        name = "plain"

        def on_insert(self, key, parent): ...
        def on_access(self, key): ...
        def on_remove(self, key): ...
        def victims(self):
            return iter(())

    with pytest.raises(TypeError, match="does not order slots"):
        Plain().order_slots(str)
    policy = LRUPolicy()
    policy.insert("a")
    with pytest.raises(RuntimeError, match="after keys were inserted"):
        policy.order_slots(str)
