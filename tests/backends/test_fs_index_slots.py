"""The fs tier's index hands every built-in eviction policy slots (``SlotKeys``),
which it gives to other keys once theirs have left: it must evict exactly what
it evicts with the same policy handed keys, what the policy remembers of keys
that left included."""

from __future__ import annotations

import random

import pytest

from lmkv.contracts.policy import EvictionPolicy
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv_backends.tiers.fs_index import EntryIndex
from lmkv_policies.arc import ARCPolicy
from lmkv_policies.lfu import LFUPolicy
from lmkv_policies.lru import LRUPolicy
from lmkv_policies.s3fifo import S3FIFOPolicy

META = KeyMeta("fs-index-slots")
POLICIES = (LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy)


def key(i: int) -> CacheKey:
    return CacheKey(META, i.to_bytes(32, "little"))


def keyed(policy: type[EvictionPolicy]) -> EvictionPolicy:
    """``policy`` handed keys, not slots."""
    return type(f"Keyed{policy.__name__}", (policy,), {"orders_slots": False})()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_the_slot_index_evicts_exactly_what_the_keyed_one_does(
        policy: type[EvictionPolicy], seed: int) -> None:
    """Writes of prompts (reserve, then commit, evicting in passes), reads,
    removals, pins and writes that cannot fit (rolled back): after each step
    both indexes hold the same entries and offer the same candidates."""
    rng = random.Random(seed)
    slots, keys = EntryIndex(policy(), capacity=200), EntryIndex(keyed(policy), capacity=200)
    assert slots._by_slot and not keys._by_slot
    for step in range(600):
        op = rng.random()
        if op < 0.5:  # a prompt of 1-6 chunks, some of them evicted earlier
            start = rng.randrange(0, 120, 4)
            chain = [key(i) for i in range(start, start + rng.randrange(1, 7))]
            for i, k in enumerate(chain):
                size = rng.choice((10, 10, 10, 25))
                parent = chain[i - 1] if i else None
                got = [index.reserve(size) for index in (slots, keys)]
                assert got[0] == got[1], f"another eviction at step {step}"
                if got[0] is None:
                    break
                for index in (slots, keys):
                    index.commit(k, size, size, parent)
        elif op < 0.75:
            first = rng.randrange(0, 120, 4)
            for index in (slots, keys):
                for k in [key(i) for i in range(first, first + 4)]:
                    index.touch(k)
        elif op < 0.85:
            victim = key(rng.randrange(0, 126))
            assert slots.discard(victim) == keys.discard(victim)
        elif op < 0.95:
            pinned = key(rng.randrange(0, 126))
            assert slots.lookup(pinned, pin=True) == keys.lookup(pinned, pin=True)
            assert slots.reserve(500) is keys.reserve(500) is None  # too big: nothing changes
            slots.unpin(pinned)
            keys.unpin(pinned)
        else:
            assert slots.reserve(190) == keys.reserve(190)  # nearly everything goes
            slots.release(190)
            keys.release(190)
        assert slots.candidates() == keys.candidates(), f"the orders part at step {step}"
        assert (slots.usage, len(slots)) == (keys.usage, len(keys))
