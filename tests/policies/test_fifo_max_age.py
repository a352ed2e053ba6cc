from __future__ import annotations

from dataclasses import dataclass

from lmkv.config.model import load_config
from lmkv.contracts.policy import OffloadContext
from lmkv_policies.fifo_max_age import FIFOMaxAgeOffloadPolicy


@dataclass
class Meta:
    req_id: str


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finish(policy, *ids: str) -> None:
    for req_id in ids:
        policy.add(Meta(req_id), {})
        policy.mark_req_finished(req_id)


def test_behaves_like_fifo_at_the_threshold() -> None:
    clock = Clock()
    policy = FIFOMaxAgeOffloadPolicy({"max_age_s": 5}, OffloadContext(threshold=2, clock=clock))
    finish(policy, "a")
    assert policy.pop_items_for_offload(10) == []
    finish(policy, "b")
    assert [i.req_id for i in policy.pop_items_for_offload(10)] == ["a", "b"]


def test_flushes_requests_below_the_threshold_once_they_are_old() -> None:
    clock = Clock()
    policy = FIFOMaxAgeOffloadPolicy({"max_age_s": 5}, OffloadContext(threshold=100, clock=clock))
    finish(policy, "a", "b")
    policy.add(Meta("running"), {})
    clock.now += 4.9
    assert policy.pop_items_for_offload(10) == []  # FIFO would wait for 98 more
    clock.now += 0.2
    assert [i.req_id for i in policy.pop_items_for_offload(1)] == ["a"]
    assert [i.req_id for i in policy.pop_items_for_offload(1)] == ["b"]
    assert policy.pop_items_for_offload(1) == []  # the running request stays
    assert len(policy) == 1 and policy.ready_count == 0


def test_age_counts_from_the_oldest_remaining_finish() -> None:
    clock = Clock()
    policy = FIFOMaxAgeOffloadPolicy({"max_age_s": 5}, OffloadContext(threshold=100, clock=clock))
    finish(policy, "a")
    clock.now += 6
    finish(policy, "b")
    assert [i.req_id for i in policy.pop_items_for_offload(1)] == ["a"]
    assert policy.pop_items_for_offload(1) == []  # b finished only now
    clock.now += 5
    assert [i.req_id for i in policy.pop_items_for_offload(1)] == ["b"]


def test_selectable_by_config() -> None:
    config = load_config(env={}, overrides={
        "lmkv.lazy_offload_policy": {"type": "FIFO_MAX_AGE", "options": {"max_age_s": 1.5}}})
    assert config.resolved_dump()["lazy_offload_policy"]["options"] == {"max_age_s": 1.5}
