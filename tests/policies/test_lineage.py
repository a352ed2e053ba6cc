"""The eviction base: lineage (parents, leaves) and the leaf filter every policy gets."""

from __future__ import annotations

from lmkv.contracts.policy import EvictionPolicy, Lineage
from lmkv_policies.lru import LRUPolicy


def test_lineage_counts_children_and_leaves():
    tree = Lineage()
    tree.add("a")
    tree.add("b", "a")
    tree.add("c", "b")
    tree.add("x", "b")
    assert [tree.is_leaf(k) for k in "abcx"] == [False, False, True, True]
    assert tree.children("b") == 2 and tree.parent("c") == "b"
    tree.discard("c")
    assert not tree.is_leaf("b")
    tree.discard("x")
    assert tree.is_leaf("b") and not tree.is_leaf("a")
    tree.add("b", "a")  # re-insert: counted once
    assert tree.children("a") == 1
    tree.discard("b")
    tree.discard("b")  # unknown: no-op
    assert tree.is_leaf("a") and len(tree) == 1


def test_a_child_stored_before_its_parent_still_protects_it():
    tree = Lineage()
    tree.add("b", "a")  # promoted tail first, head later
    tree.add("a")
    assert not tree.is_leaf("a")


def test_candidates_are_leaves_only_in_policy_order():
    policy = LRUPolicy()
    for i, key in enumerate("abcd"):
        policy.insert(key, "abcd"[i - 1] if i else None)
    policy.insert("x")
    assert list(policy.candidates()) == ["d", "x"]
    policy.forget("d")
    assert list(policy.candidates()) == ["c", "x"]


class _OldStyle(EvictionPolicy):
    """A third-party policy written before policies learned parents."""

    name = "old-style"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys: list = []

    def on_insert(self, key):
        self.keys.append(key)

    def on_access(self, key):
        pass

    def on_remove(self, key):
        self.keys.remove(key)

    def victims(self):
        return iter(list(self.keys))


def test_a_policy_without_parents_is_left_out_at_load():
    """lmkv calls ``on_insert(key, parent)``: a policy that cannot take the parent
    is found by the load check, never by a tier's put."""
    from lmkv.plugins.contract import check

    problem = check("eviction_policy", _OldStyle, EvictionPolicy).problem
    assert "on_insert(self, key) cannot be called as on_insert(key, parent)" in problem
