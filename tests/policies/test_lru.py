from __future__ import annotations

from lmkv_policies.lru import LRUPolicy


def test_order_follows_recency() -> None:
    policy = LRUPolicy()
    for k in "abcd":
        policy.on_insert(k)
    policy.on_access("a")
    policy.on_remove("c")
    policy.on_access("zz")  # unknown keys are ignored
    assert list(policy.victims()) == ["b", "d", "a"]
    policy.on_insert("b")  # re-insert refreshes
    assert list(policy.victims()) == ["d", "a", "b"]
