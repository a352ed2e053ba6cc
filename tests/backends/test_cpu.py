from __future__ import annotations

import random

import pytest
import torch

from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.testing import StorageBackendConformance
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy

SHAPE = (2, 2, 16, 2, 32)
CHUNK_BYTES = 2 * 2 * 16 * 2 * 32 * 2


def make_cpu(max_bytes: int = 1 << 20) -> CPUBackend:
    return CPUBackend(CPUBackend.Options(max_bytes=max_bytes),
                      BackendContext(eviction_policy=LRUPolicy()))


class TestCPUConformance(StorageBackendConformance):
    backend_class = CPUBackend
    outlives_process = False
    per_process_reason = "the cpu tier is its process's memory: it goes with the process"

    def backend_options(self) -> dict[str, object]:
        return {"max_bytes": 1 << 20}

    def make_unreachable(self, backend: CPUBackend) -> None:
        pytest.skip("the cpu tier is this process's memory: it cannot be out of reach")


class PinIgnoringCPU(CPUBackend):
    """Says it pins, and pins nothing: the conformance suite must catch it."""

    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return super().contains(key)

    def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:
        return super().batched_async_contains(lookup_id, keys)

    def unpin(self, key: CacheKey) -> bool:
        return self.contains(key)


def test_the_conformance_suite_catches_a_backend_that_ignores_pins() -> None:
    backend = PinIgnoringCPU(CPUBackend.Options(max_bytes=1 << 20),
                             BackendContext(eviction_policy=LRUPolicy()))
    with pytest.raises(AssertionError, match="pinned key 0 was evicted"):
        TestCPUConformance().test_a_pinned_entry_survives_eviction_pressure(backend)


def key(i: int) -> CacheKey:
    return CacheKey(KeyMeta("m"), i.to_bytes(32, "little"))


def put(tier: CPUBackend, i: int) -> bool:
    obj = tier.allocate(SHAPE, torch.float16)
    if obj is None:
        return False
    obj.tensor.fill_(i % 1000)
    stored = tier.batched_submit_put([key(i)], [obj]).result()
    obj.ref_down()
    return stored == 1


def test_lru_eviction_keeps_recent_entries() -> None:
    tier = make_cpu(4 * CHUNK_BYTES)
    for i in range(4):
        assert put(tier, i)
    obj = tier.get_blocking(key(0))  # 0 becomes most recent
    obj.ref_down()
    assert put(tier, 4)
    assert [tier.contains(key(i)) for i in range(5)] == [True, False, True, True, True]
    assert tier.stats()["evictions"] == 1


def test_pinned_and_referenced_entries_are_never_evicted() -> None:
    tier = make_cpu(4 * CHUNK_BYTES)
    for i in range(4):
        put(tier, i)
    tier.pin(key(0))
    held = tier.get_blocking(key(1))
    for i in range(4, 10):
        put(tier, i)
    assert tier.contains(key(0)) and tier.contains(key(1))
    assert torch.all(held.tensor == 1)
    # everything left is pinned or referenced: nothing can be evicted
    tier.pin(key(8))
    tier.pin(key(9))
    assert tier.allocate(SHAPE, torch.float16) is None
    held.ref_down()
    assert put(tier, 10)
    assert not tier.contains(key(1))
    for k in (0, 8, 9):
        tier.unpin(key(k))


def test_removing_a_pinned_entry_is_refused() -> None:
    tier = make_cpu()
    put(tier, 1)
    tier.pin(key(1))
    assert not tier.remove(key(1))
    tier.unpin(key(1))
    assert tier.remove(key(1))


def test_put_of_a_foreign_buffer_is_copied_in() -> None:
    tier = make_cpu()
    from lmkv.memory import tensor_obj

    obj = tensor_obj(torch.full(SHAPE, 3.0, dtype=torch.float16))
    assert tier.batched_submit_put([key(1)], [obj]).result() == 1
    obj.tensor.fill_(0)
    got = tier.get_blocking(key(1))
    assert torch.all(got.tensor == 3)
    got.ref_down()


def test_workload_ten_times_the_budget_holds_it_and_leaks_nothing() -> None:
    budget = 16 * CHUNK_BYTES
    tier = make_cpu(budget)
    rng = random.Random(0)
    total_bytes = 0
    held, pinned = [], []
    for step in range(2000):
        op = rng.random()
        if op < 0.5:
            if put(tier, step):
                total_bytes += CHUNK_BYTES
        elif op < 0.75:
            obj = tier.get_blocking(key(rng.randrange(step + 1)))
            if obj is not None:
                held.append(obj)
        elif op < 0.9:
            k = key(rng.randrange(step + 1))
            if tier.batched_async_contains("x", [k], pin=True):
                pinned.append(k)
        else:
            while held:
                held.pop().ref_down()
            while pinned:
                assert tier.unpin(pinned.pop())
        assert tier.allocator.used_bytes <= budget
        assert tier.usage_bytes <= budget
    assert total_bytes >= 10 * budget
    while held:
        held.pop().ref_down()
    while pinned:
        assert tier.unpin(pinned.pop())
    # every pin and reference the workload took is back: only the tier's own remain
    assert all(refs == (1, 0) for refs in tier.entry_refs())
    tier.clear()
    assert tier.allocator.used_bytes == 0
    assert tier.allocator.live_objects == 0


@pytest.mark.parametrize("n", [1, 128])
def test_batched_contains_is_a_prefix(n: int) -> None:
    tier = make_cpu()
    for i in range(n):
        put(tier, i)
    keys = [key(i) for i in range(n + 5)]
    assert tier.batched_async_contains("x", keys) == n


def test_an_impossible_allocation_evicts_nothing() -> None:
    tier = make_cpu(4 * CHUNK_BYTES)
    for i in range(4):
        put(tier, i)
    assert tier.allocate((4 * 2 + 1, *SHAPE[1:]), torch.float16) is None  # larger than the arena
    assert len(tier) == 4 and tier.stats()["evictions"] == 0


def test_fragmentation_around_pins_does_not_empty_the_tier() -> None:
    tier = make_cpu(8 * CHUNK_BYTES)
    for i in range(8):
        put(tier, i)
    for i in range(0, 8, 2):
        tier.pin(key(i))  # every other block pinned: no two free blocks can merge
    double = (SHAPE[0] * 2, *SHAPE[1:])
    assert tier.allocate(double, torch.float16) is None
    assert len(tier) >= 5  # gave up after a bounded number of evictions
    for i in range(0, 8, 2):
        tier.unpin(key(i))


def test_concurrent_clients_keep_counts_and_budget() -> None:
    import threading

    budget = 32 * CHUNK_BYTES
    tier = make_cpu(budget)
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        held, pinned = [], []
        try:
            for step in range(400):
                k = rng.randrange(64)
                op = rng.random()
                if op < 0.4:
                    put(tier, k)
                elif op < 0.6:
                    obj = tier.get_blocking(key(k))
                    if obj is not None:
                        assert torch.all(obj.tensor == k % 1000)
                        held.append(obj)
                elif op < 0.75:
                    if tier.batched_async_contains("x", [key(k)], pin=True):
                        pinned.append(key(k))
                elif op < 0.85:
                    tier.remove(key(k))
                else:
                    while held:
                        held.pop().ref_down()
                    while pinned:
                        assert tier.unpin(pinned.pop())
                assert tier.allocator.used_bytes <= budget
                if step % 50 == 0:
                    assert tier.usage_bytes <= budget
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            while held:
                held.pop().ref_down()
            while pinned:
                tier.unpin(pinned.pop())

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(refs == (1, 0) for refs in tier.entry_refs())
    tier.clear()
    assert tier.allocator.used_bytes == 0 and tier.allocator.live_objects == 0


# -- a budget larger than the machine ------------------------------------------

def test_budget_beyond_available_memory_is_valid_and_refused_where_the_arena_is_made(
        ) -> None:
    """A config's validity does not depend on this moment's free memory: it loads
    (with a warning for config check), and the arena is what refuses it."""
    from lmkv.base.errors import ConfigError
    from lmkv.config.model import load_config
    from lmkv.memory.shm import available_memory_bytes
    from lmkv.storage.manager import StorageManager

    available = available_memory_bytes()
    assert available is not None  # Linux: MemAvailable
    too_big = available + (1 << 30)
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        {"type": "cpu", "options": {"max_bytes": too_big}}]})
    [warning] = config.startup_warnings()
    assert warning.startswith("config key 'tiers.1.options.max_bytes' (from lmkv.tiers): ")
    assert "is more than the memory this machine has available" in warning
    assert warning.endswith("the tier will not start here: lower it, or set "
                            "allow_overcommit: true")
    with pytest.raises(ConfigError) as info:
        StorageManager.from_config(config)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config key 'tiers.1.options.max_bytes' = ")
    assert "more than the memory this machine has available (" in message
    assert message.endswith("lower it, or set allow_overcommit: true")


def test_an_unaddressable_budget_is_invalid_with_a_readable_bound() -> None:
    from lmkv.base.errors import ConfigError
    from lmkv.config.model import load_config

    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.tiers.0.options.max_bytes": 10**32})
    assert str(info.value) == (
        f"config key 'tiers.0.options.max_bytes' = {10**32} (from "
        "lmkv.tiers.0.options.max_bytes): must be at most 64.0PiB (more than a 64-bit "
        "process can map)")


@pytest.mark.parametrize("command", [["stats", "--config"], ["server", "--config"]])
@pytest.mark.slow  # lmkv commands in processes
def test_oversized_tier_is_one_line_where_the_arena_is_made(tmp_path, command) -> None:
    from tests.conftest import run_cli

    config = tmp_path / "big.yaml"
    config.write_text("tiers:\n  - type: cpu\n    options: {max_bytes: 1PiB}\n")
    extra = ["--socket", str(tmp_path / "s.sock")] if command[0] == "server" else []
    result = run_cli(*command, str(config), *extra)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = result.stderr.splitlines()
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("lmkv: error: config key 'tiers.0.options.max_bytes' = "
                                "1.0PiB: more than the memory this machine has available (")


def test_default_budget_is_not_held_against_a_small_machine(monkeypatch) -> None:
    import lmkv_backends.tiers.cpu as cpu

    monkeypatch.setattr(cpu, "available_memory_bytes", lambda: 1 << 30)
    assert cpu.CPUOptions().max_bytes == 4 << 30
    assert cpu.CPUOptions().memory_shortfall() is None
    assert cpu.CPUOptions(max_bytes="2GiB").memory_shortfall() == (
        "more than the memory this machine has available (1.0GiB)")


def test_an_arena_that_cannot_be_allocated_is_one_config_error_naming_the_key() -> None:
    """allow_overcommit lets 1 PiB past validation; no kernel maps that much
    (x86-64 user space is 128 TiB): one line naming the tier's key, no OSError."""
    from lmkv.base.errors import ConfigError

    options = CPUBackend.Options(max_bytes="1PiB", allow_overcommit=True, pin_memory=False)
    with pytest.raises(ConfigError) as info:
        CPUBackend(options, BackendContext(eviction_policy=LRUPolicy(), tier_index=2))
    message = str(info.value)
    assert "'tiers.2.options.max_bytes'" in message and "could not be allocated" in message
    assert "\n" not in message


def test_a_private_arena_is_prefaulted_ahead_only_when_asked() -> None:
    def ahead(**options: object) -> int | None:
        tier = CPUBackend(CPUBackend.Options(pin_memory=False, shared_memory=False, **options),
                          BackendContext(eviction_policy=LRUPolicy()))
        prefaulter = tier.allocator.prefaulter
        return None if prefaulter is None else prefaulter._ahead

    if ahead(max_bytes="64MiB", prefault_ahead="1MiB") is None:
        pytest.skip("no MADV_POPULATE_WRITE on this platform")
    assert ahead(max_bytes="64MiB", prefault_ahead="1MiB") == 1 << 20
    assert ahead(max_bytes="64MiB") is None  # off by default
    assert ahead(max_bytes="64MiB", prefault_ahead=None) is None
    assert ahead(max_bytes="64MiB", prefault_ahead=0) is None
