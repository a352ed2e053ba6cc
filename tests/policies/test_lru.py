from __future__ import annotations

from lmkv_policies.lru import LRUPolicy


def test_order_follows_recency() -> None:
    policy = LRUPolicy()
    for k in "abcd":
        policy.insert(k)
    policy.access("a")
    policy.forget("c")
    policy.access("zz")  # unknown keys are ignored
    assert list(policy.victims()) == ["b", "d", "a"]
    policy.insert("b")  # re-insert refreshes
    assert list(policy.victims()) == ["d", "a", "b"]


def test_a_prompt_goes_tail_first_and_a_head_read_since_stays() -> None:
    policy = LRUPolicy()
    for i, k in enumerate("abc"):
        policy.insert(k, "abc"[i - 1] if i else None)
    policy.insert("x")
    policy.insert("y")
    assert list(policy.victims()) == ["c", "x", "y"]  # leaves only
    policy.forget("c")
    assert list(policy.victims()) == ["b", "x", "y"]  # b was used before c: first
    policy.access("a")  # a prompt that ends at a: a is newer than x and y
    policy.forget("b")
    assert list(policy.victims()) == ["x", "y", "a"]
    policy.access("x")
    assert list(policy.victims()) == ["y", "a", "x"]


def test_the_order_is_exact_recency_over_leaves() -> None:
    """Random trees, reads and evictions: victims() is always the stored leaves in
    the order of their last use (what a scan over every key would give)."""
    import random

    rng = random.Random(3)
    policy = LRUPolicy()
    parent: dict[int, int | None] = {}
    used: dict[int, int] = {}
    for clock, step in enumerate(range(3000), 1):
        roll = rng.random()
        if roll < 0.4 or not parent:
            k = step
            p = rng.choice(list(parent)) if parent and rng.random() < 0.7 else None
            policy.insert(k, p)
            parent[k], used[k] = p, clock
        elif roll < 0.8:
            k = rng.choice(list(parent))
            policy.access(k)
            used[k] = clock
        else:
            k = next(iter(policy.candidates()))
            policy.forget(k)
            del parent[k], used[k]
        inner = {p for p in parent.values() if p is not None}
        leaves = sorted((k for k in parent if k not in inner), key=used.__getitem__)
        assert list(policy.victims()) == leaves, step
