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
