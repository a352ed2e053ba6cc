"""The behaviour that sets lfu, arc and s3fifo apart (their contract is in
test_conformance.py)."""

from __future__ import annotations

from lmkv_policies.arc import ARCPolicy
from lmkv_policies.lfu import LFUPolicy
from lmkv_policies.s3fifo import S3FIFOPolicy


def test_lfu_evicts_the_least_used_leaf_least_recent_first() -> None:
    policy = LFUPolicy()
    for k in "abc":
        policy.insert(k)
    for _ in range(3):
        policy.access("a")
    policy.access("c")
    assert list(policy.victims()) == ["b", "c", "a"]


def test_lfu_parent_comes_back_with_its_count() -> None:
    policy = LFUPolicy()
    policy.insert("h")
    policy.insert("t", "h")
    policy.insert("x")
    for _ in range(3):
        policy.access("h")
    assert list(policy.victims()) == ["t", "x"]
    policy.forget("t")
    assert list(policy.victims()) == ["x", "h"]


def test_lfu_ageing_lets_new_keys_beat_old_hot_ones() -> None:
    policy = LFUPolicy({"decay_period": 10, "decay_factor": 0.5})
    policy.insert("old")
    for _ in range(8):
        policy.access("old")  # 9 uses: aged down to 4 at the 10th use
    policy.insert("new")
    assert policy._count["old"] == 4
    for _ in range(6):
        policy.access("new")
    assert next(iter(policy.victims())) == "old"
    no_ageing = LFUPolicy({"decay_factor": 1})
    no_ageing.insert("k")
    for _ in range(300):
        no_ageing.access("k")
    assert no_ageing._count["k"] == 255  # max_frequency


def test_arc_reads_move_keys_to_t2_and_t1_goes_first() -> None:
    policy = ARCPolicy()
    for k in "abcd":
        policy.insert(k)
    policy.access("a")
    policy.access("b")
    # T1 = c, d (seen once) holds more than the target p = 0: it goes first
    assert list(policy.victims()) == ["c", "d", "a", "b"]


def test_arc_ghost_hits_adapt_the_target_and_ghosts_are_bounded() -> None:
    policy = ARCPolicy()
    for k in range(4):
        policy.insert(k)
    policy.forget(0)  # evicted from T1: a ghost in B1
    assert policy.ghosts() == 1
    policy.insert(0)  # a B1 hit: recency wanted more room
    assert policy.p == 1.0 and policy._list[0] == 2
    policy.access(1)
    policy.forget(1)  # evicted from T2: a ghost in B2
    policy.insert(1)  # a B2 hit: frequency wanted more room
    assert policy.p == 0.0
    for k in range(100, 200):  # churn: ghosts stay within 2c of the 4 entries held
        policy.insert(k)
        policy.forget(k)
        assert len(policy) + policy.ghosts() <= 2 * policy.c


def test_s3fifo_one_hit_wonders_leave_through_the_small_queue() -> None:
    policy = S3FIFOPolicy({"small_ratio": 0.25})
    for k in range(8):
        policy.insert(k)
    policy.access(0)
    policy.access(1)
    # 0 and 1 were read while in the small queue: they move to main; 2.. go
    assert list(policy.victims())[:3] == [2, 3, 4]
    for k in (2, 3, 4):
        policy.forget(k)
    assert policy.ghosts() == 3
    policy.insert(2)  # a ghost comes back straight into the main queue
    assert policy._queue[2] == 1


def test_s3fifo_a_chosen_key_read_before_it_goes_stays() -> None:
    policy = S3FIFOPolicy()
    for k in range(3):
        policy.insert(k)
    first = next(policy.victims())
    assert first == 0
    policy.access(0)  # read after it was chosen (e.g. the tier could not evict it yet)
    assert list(policy.victims())[:2] == [1, 2]
    assert 0 in policy._queue and policy._queue[0] == 1
