from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.contracts.policy import OffloadContext
from lmkv_policies.fifo import FIFOOffloadPolicy


@dataclass
class Meta:
    req_id: str
    step: int = 0


def fill(policy: FIFOOffloadPolicy, ids: list[str], finished: bool = True) -> None:
    for req_id in ids:
        policy.add(Meta(req_id), {hash(req_id) % 100: req_id})
        if finished:
            policy.mark_req_finished(req_id)


def test_only_finished_requests_are_popped() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=1))
    fill(policy, ["a"], finished=False)
    fill(policy, ["b"])
    fill(policy, ["c"], finished=False)
    fill(policy, ["d"])
    assert [i.req_id for i in policy.pop_items_for_offload(10)] == ["b", "d"]
    assert len(policy) == 2  # a and c stay pending


def test_popped_items_leave_pending_set_and_ready_count() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=1))
    fill(policy, ["a", "b"])
    assert policy.ready_count == 2
    policy.pop_items_for_offload(1)
    assert policy.ready_count == 1 and len(policy) == 1
    with pytest.raises(ValueError):
        policy.mark_req_finished("a")  # popped: no longer pending


def test_threshold_1_select_2_pops_six_as_three_batches() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=1))
    fill(policy, [f"r{i}" for i in range(6)])
    batches = [[i.req_id for i in policy.pop_items_for_offload(2)] for _ in range(4)]
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], []]


def test_threshold_20_select_10_needs_ten_more_finishes() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=20))
    fill(policy, [f"r{i}" for i in range(19)])
    assert policy.pop_items_for_offload(10) == []
    fill(policy, ["r19"])
    assert len(policy.pop_items_for_offload(10)) == 10
    assert policy.ready_count == 10
    fill(policy, [f"s{i}" for i in range(9)])
    assert policy.pop_items_for_offload(10) == []  # 19 ready: below threshold
    fill(policy, ["s9"])
    assert [i.req_id for i in policy.pop_items_for_offload(10)] == [f"r{i}" for i in range(10, 20)]


@pytest.mark.parametrize("count", [0, -1])
def test_non_positive_count_returns_nothing(count: int) -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=1))
    fill(policy, ["a"])
    assert policy.pop_items_for_offload(count) == []
    assert policy.ready_count == 1


def test_unknown_request_raises_value_error() -> None:
    with pytest.raises(ValueError, match="nope"):
        FIFOOffloadPolicy(None, OffloadContext(threshold=1)).mark_req_finished("nope")


def test_steps_of_one_request_aggregate_into_one_item() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=1))
    policy.add(Meta("a", 0), {1: "h1", 2: "h2"})
    policy.add(Meta("b", 0), {5: "h5"})
    policy.add(Meta("a", 1), {3: "h3"})
    assert len(policy) == 2
    policy.mark_req_finished("a")
    (item,) = policy.pop_items_for_offload(5)
    assert item.req_id == "a"
    assert [m.step for m in item.metas] == [0, 1]
    assert item.block_hashes == {1: "h1", 2: "h2", 3: "h3"}


def test_finishing_twice_counts_once() -> None:
    policy = FIFOOffloadPolicy(None, OffloadContext(threshold=2))
    fill(policy, ["a"])
    policy.mark_req_finished("a")
    assert policy.ready_count == 1


@pytest.mark.parametrize("bad", [0, -5, "x"])
def test_threshold_must_be_a_positive_integer(bad) -> None:
    with pytest.raises(ValueError):
        FIFOOffloadPolicy(None, OffloadContext(threshold=bad))


def test_config_validation_of_the_lazy_offload_keys() -> None:
    config = load_config(env={}, overrides={"lmkv.lazy_offload_policy": "fifo"})
    assert config.lazy_offload_policy.type == "fifo"
    with pytest.raises(ConfigError, match="available: FIFO"):
        load_config(env={}, overrides={"lmkv.lazy_offload_policy": "LRU"})
