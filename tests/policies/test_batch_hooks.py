"""``insert_many`` / ``access_many`` (eviction policy API 2.2): which policies get
the batch hooks, and what the others get instead."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import pytest

from lmkv.contracts.policy import EvictionContext, EvictionPolicy
from lmkv.plugins.contract import check
from lmkv_policies.lru import LRUPolicy


class Recorder(EvictionPolicy):
    """Orders slots by arrival; writes down every hook call."""

    name = "recorder"
    api_version = "2.2"
    orders_slots = True

    def __init__(self, options: Any = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        self.calls: list[tuple] = []
        self.order: dict[Hashable, None] = {}

    def use_slots(self) -> None:
        pass

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        self.calls.append(("insert", key, parent))
        self.order[key] = None

    def on_extended(self, key: Hashable) -> None:
        self.calls.append(("extended", key))

    def on_access(self, key: Hashable) -> None:
        self.calls.append(("access", key))

    def on_remove(self, key: Hashable) -> None:
        self.order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(list(self.order))


class Batching(Recorder):
    name = "batching"

    def on_insert_many(self, keys: list[Any], parents: list[Any]) -> None:
        self.calls.append(("insert_many", list(keys), list(parents),
                           [self.lineage.children(k) for k in keys]))
        for key in keys:
            self.order[key] = None

    def on_access_many(self, keys: Sequence[Any]) -> None:
        self.calls.append(("access_many", list(keys)))


class OldBatching(Batching):
    """Written for 2.1: hooks of these names are not lmkv's to call."""

    name = "old-batching"
    api_version = "2.1"

    # (a 2.1 class declaring the methods itself)
    def on_insert_many(self, keys: list[Any], parents: list[Any]) -> None:
        raise AssertionError("a 2.1 policy's on_insert_many was called")

    def on_access_many(self, keys: Sequence[Any]) -> None:
        raise AssertionError("a 2.1 policy's on_access_many was called")


class OwnAccess(Batching):
    """A subclass with its own on_access: the inherited batch hook cannot stand for it."""

    name = "own-access"

    def on_access(self, key: Hashable) -> None:
        self.calls.append(("own access", key))


def _slots(policy: EvictionPolicy) -> EvictionPolicy:
    policy.order_slots(lambda slot: f"key {slot}")
    return policy


def test_a_batch_goes_to_the_hook_once_with_its_lineage_in_place() -> None:
    policy = _slots(Batching(None, EvictionContext()))
    policy.insert(0)
    policy.insert_many([1, 2, 3], [0, 1, 2])
    policy.access_many([0, 1, 2, 3])
    assert policy.calls == [
        ("insert", 0, None),
        ("insert_many", [1, 2, 3], [0, 1, 2], [1, 1, 0]),  # children: the whole batch
        ("access_many", [0, 1, 2, 3]),
    ]
    assert list(policy.candidates()) == [3] and len(policy.lineage) == 4


def test_a_stored_key_in_a_batch_goes_through_insert_alone() -> None:
    policy = _slots(Batching(None, EvictionContext()))
    policy.insert_many([0, 1], [None, 0])
    policy.calls.clear()
    policy.insert_many([2, 1, 3], [1, 0, 2])  # 1 is stored: forgotten, stored again
    assert [call[0] for call in policy.calls] == ["insert_many", "extended", "insert",
                                                  "insert_many"]
    assert policy.calls[0][1] == [2] and policy.calls[2][1:] == (1, 0)
    assert policy.calls[3][1] == [3]
    assert len(policy.lineage) == 4


def test_without_hooks_or_for_an_older_api_each_key_gets_its_hooks() -> None:
    for cls in (Recorder, OldBatching):
        policy = _slots(cls(None, EvictionContext()))
        policy.insert_many([0, 1, 2], [None, 0, 1])
        policy.access_many([0, 2])
        assert policy.calls == [
            ("insert", 0, None), ("extended", 0), ("insert", 1, 0), ("extended", 1),
            ("insert", 2, 1), ("access", 0), ("access", 2)], cls.name
    assert not check("eviction_policy", OldBatching, EvictionPolicy).problem


def test_a_subclass_with_its_own_per_key_hook_gets_that_hook() -> None:
    policy = _slots(OwnAccess(None, EvictionContext()))
    policy.insert_many([0, 1], [None, 0])
    policy.access_many([0, 1])
    assert policy.calls[0][0] == "insert_many"  # its on_insert is the batching one's
    assert policy.calls[1:] == [("own access", 0), ("own access", 1)]


def test_keys_not_slots_take_one_insert_each() -> None:
    policy = Batching(None, EvictionContext())  # no order_slots: keys
    policy.insert_many(["a", "b"], [None, "a"])
    assert [call[0] for call in policy.calls] == ["insert", "extended", "insert"]


def test_lru_batches_declare_the_api_they_use() -> None:
    assert LRUPolicy.api_version == "2.2"
    assert not check("eviction_policy", LRUPolicy, EvictionPolicy).problem
    policy = _slots(LRUPolicy(None, EvictionContext()))
    assert policy._batched("on_insert_many") is not None
    assert policy._batched("on_access_many") is not None


class OldWithSameNames(Recorder):
    """Written for 2.1, with members of the names 2.2 added, its own."""

    name = "old-same-names"
    api_version = "2.1"

    def insert_many(self, anything: object) -> None:  # type: ignore[override]
        raise AssertionError("lmkv called a 2.1 policy's own insert_many")

    def on_access_many(self) -> None:  # type: ignore[override]
        raise AssertionError("lmkv called a 2.1 policy's own on_access_many")


def test_a_policy_for_an_older_api_keeps_members_of_the_new_names() -> None:
    """A 2.1 class may have had an ``insert_many`` or an ``on_access_many`` of its
    own: it still loads, and lmkv calls the base's batch methods, never its own."""
    assert not check("eviction_policy", OldWithSameNames, EvictionPolicy).problem
    policy = _slots(OldWithSameNames(None, EvictionContext()))
    EvictionPolicy.insert_many(policy, [0, 1], [None, 0])
    EvictionPolicy.access_many(policy, [1])
    assert [call[0] for call in policy.calls] == ["insert", "extended", "insert", "access"]


class Undeclared(LRUPolicy):
    """A subclass of lru declaring no version, with a batch hook of its own."""

    name = "undeclared-lru"

    def on_access_many(self, keys: Sequence[Any]) -> None:
        raise AssertionError("the hook of a class not written for 2.2 was called")


class OwnInsertLRU(LRUPolicy):
    """A subclass of lru (written for 2.1) with its own on_insert."""

    name = "own-insert-lru"
    api_version = "2.1"

    def __init__(self, options: Any = None, context: EvictionContext | None = None) -> None:
        super().__init__(options, context)
        self.seen: list[Hashable] = []

    def on_insert(self, key: Hashable, parent: Hashable | None) -> None:
        self.seen.append(key)
        super().on_insert(key, parent)


def test_hooks_count_only_from_the_class_that_declares_2_2() -> None:
    policy = _slots(Undeclared(None, EvictionContext()))
    policy.insert_many([0, 1], [None, 0])
    policy.access_many([0, 1])  # per key: the subclass's hook is not taken
    assert list(policy.candidates()) == [1]


def test_a_subclass_of_lru_with_its_own_on_insert_has_it_called() -> None:
    policy = _slots(OwnInsertLRU(None, EvictionContext()))
    policy.insert_many([0, 1, 2], [None, 0, 1])
    policy.insert(3)
    assert policy.seen == [0, 1, 2, 3]
    assert list(policy.candidates()) == [2, 3]


def test_a_batch_with_too_few_parents_changes_nothing() -> None:
    policy = _slots(LRUPolicy(None, EvictionContext()))
    with pytest.raises(ValueError, match="3 keys but 2 parents"):
        policy.insert_many([0, 1, 2], [None, 0])
    assert len(policy.lineage) == 0 and list(policy.candidates()) == []



def test_a_hook_counts_from_a_third_party_plugins_declaration_above_it() -> None:
    """A plugin package named ``lmkv_...`` is not lmkv's: a class of it that
    defines a batch hook without a version of its own is written for the one a
    class of the same plugin above it declares (as the contract check reads it)."""
    got: list[list] = []
    declares = type("Declares", (Recorder,), {"__module__": "lmkv_thirdparty.policy",
                                              "api_version": "2.2"})
    hooked = type("Hooked", (declares,), {
        "__module__": "lmkv_thirdparty.policy", "name": "third-party-hooked",
        "on_access_many": lambda self, keys: got.append(list(keys))})
    policy = _slots(hooked(None, EvictionContext()))
    policy.insert_many([0, 1], [None, 0])
    policy.access_many([0, 1])
    assert got == [[0, 1]]
    assert not [call for call in policy.calls if call[0] == "access"]
