"""``admit_after``: a tier stores a chunk from its N-th sighting only."""

from __future__ import annotations

import pytest
import torch

from lmkv.config.model import load_config
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.storage.admission import MIN_TRACKED, AdmissionGate, tracked_keys
from lmkv.storage.manager import StorageManager, chain_parents
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy

SHAPE = (2, 2, 8, 2, 8)


def key(i: int) -> CacheKey:
    return CacheKey(KeyMeta("m"), i.to_bytes(32, "little"))


def cpu() -> CPUBackend:
    return CPUBackend(CPUBackend.Options(max_bytes=1 << 20),
                      BackendContext(eviction_policy=LRUPolicy()))


def offer(manager: StorageManager, ids: list[int]) -> None:
    keys = [key(i) for i in ids]
    objs = []
    for i in ids:
        obj = manager.allocate(SHAPE, torch.float32)
        obj.tensor.fill_(i)
        objs.append(obj)
    manager.put(keys, objs, chain_parents(keys)).result()
    manager.flush()
    for obj in objs:
        obj.ref_down()


def test_the_gate_admits_from_the_nth_sighting() -> None:
    gate = AdmissionGate(3)
    keys = [key(0), key(1)]
    for sighting in (1, 2):
        kept, objs, parents, rejected = gate.admit(keys, ["a", "b"], [None, key(0)])
        assert (kept, objs, parents, rejected) == ([], [], [], 2), sighting
    assert gate.admit(keys, ["a", "b"], None) == (keys, ["a", "b"], None, 0)
    assert gate.admit(keys, ["a", "b"], None)[3] == 0  # and every sighting after


def test_a_rejected_head_rejects_its_tail_in_the_same_offer() -> None:
    gate = AdmissionGate(2)
    gate.admit([key(1)], [1], [None])  # 1 was seen before, 0 was not
    kept, _, _, rejected = gate.admit([key(0), key(1)], [0, 1], [None, key(0)])
    assert kept == [] and rejected == 2


def test_the_counts_are_bounded() -> None:
    gate = AdmissionGate(2, max_tracked=MIN_TRACKED)
    for i in range(5 * MIN_TRACKED):
        gate.admit([key(i)], [i], None)
    assert len(gate) == MIN_TRACKED
    assert tracked_keys(None, 1024) == 1 << 16
    assert tracked_keys(1 << 30, 1 << 20) == 4096  # 1,024 chunks: 4,096 counts
    assert tracked_keys(1 << 20, 1 << 20) == MIN_TRACKED
    assert tracked_keys(1 << 40, 1 << 10) == 1 << 20


@pytest.mark.parametrize("after", [0, -1, 1.5, True])
def test_a_bad_threshold_is_refused(after) -> None:
    with pytest.raises(ValueError, match="admit_after"):
        AdmissionGate(after)


def test_the_first_tier_stores_from_the_second_sighting_and_counts_rejects() -> None:
    tier = cpu()
    manager = StorageManager([tier], admit_after=[2])
    try:
        offer(manager, [0, 1, 2])
        assert len(tier) == 0 and tier.stats()["admission_rejects"] == 3
        offer(manager, [0, 1, 2])
        assert [tier.contains(key(i)) for i in range(3)] == [True, True, True]
        assert tier.stats()["admission_rejects"] == 3
    finally:
        manager.close()


def test_a_lower_tier_gate_applies_to_the_write_through_only() -> None:
    upper, lower = cpu(), cpu()
    manager = StorageManager([upper, lower], admit_after=[1, 3])
    try:
        for sighting in range(3):
            offer(manager, [5, 6])
            assert len(upper) == 2
            assert len(lower) == (2 if sighting == 2 else 0)
        assert lower.stats()["admission_rejects"] == 4
        assert upper.stats()["admission_rejects"] == 0
    finally:
        manager.close()


def test_promotions_are_sightings_of_the_first_tier() -> None:
    upper, lower = cpu(), cpu()
    manager = StorageManager([upper, lower], admit_after=[2, 1])
    try:
        offer(manager, [7])  # upper: rejected (1st sighting); lower: stored
        assert not upper.contains(key(7)) and lower.contains(key(7))
        for _ in manager.get([key(7)]):  # a lower-tier hit offered for promotion: 2nd
            pass
        assert upper.contains(key(7))
    finally:
        manager.close()


def test_config_sets_admit_after_per_tier(tmp_path) -> None:
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "1MiB"}, "admit_after": 2},
        {"type": "cpu", "options": {"max_bytes": "2MiB"}}]})
    assert [t.admit_after for t in config.tiers] == [2, 1]
    manager = StorageManager.from_config(config)
    try:
        offer(manager, [1])
        assert not manager.tiers[0].contains(key(1))
        assert manager.tiers[1].contains(key(1))
    finally:
        manager.close()
