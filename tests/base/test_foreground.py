"""Background work waits while a request is served (``lmkv.base.foreground``): the
gate itself, and the background threads that use it (the write-through writers,
the fs tier's writers, the arena's prefault thread). No timing is asserted: a
background unit must not have run while a request was marked busy (with the
wait's bound raised far past the test), and must run once it is not."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lmkv.base import foreground
from lmkv.storage.manager import StorageManager
from tests.storage.tiers import SHAPE, cpu, key


@pytest.fixture
def long_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(foreground, "MAX_YIELD_S", 30.0)


def test_the_gate_counts_nested_requests_and_bounds_the_wait() -> None:
    assert not foreground.is_busy() and foreground.wait_idle(0)
    with foreground.busy():
        with foreground.busy():
            assert foreground.is_busy()
        assert foreground.is_busy()
        assert not foreground.wait_idle(0.01)  # still busy: the bound ends the wait
    assert not foreground.is_busy()
    foreground.leave()  # an unmatched leave never makes the count negative
    assert not foreground.is_busy()

    waited: list[bool] = []
    foreground.enter()
    waiter = threading.Thread(target=lambda: waited.append(foreground.wait_idle(30)))
    waiter.start()
    time.sleep(0.05)
    assert waited == []  # waiting for the request
    foreground.leave()
    waiter.join(10)
    assert waited == [True]


def test_write_through_waits_for_the_request_to_end(long_yield) -> None:
    upper, lower = cpu(), cpu()
    manager = StorageManager([upper, lower])
    try:
        with foreground.busy():
            obj = manager.allocate(SHAPE, torch.float32)
            manager.put([key(1)], [obj])
            obj.ref_down()
            time.sleep(0.1)
            assert upper.contains(key(1)) and not lower.contains(key(1))
        assert manager.flush(10)
        assert lower.contains(key(1))
    finally:
        manager.close()


def test_a_lookup_is_busy_until_its_prefetch_answered() -> None:
    from tests.storage.test_prefetch import Gated

    upper, lower = cpu(), cpu(Gated)
    lower.gate = threading.Event()
    manager = StorageManager([upper, lower])
    seen: list[bool] = []
    try:
        obj = lower.allocate(SHAPE, torch.float32)
        lower.batched_submit_put([key(2)], [obj]).result()
        obj.ref_down()
        future = manager.lookup_and_prefetch("slow", [key(2)], [256])
        seen.append(foreground.is_busy())  # the read is on the prefetch threads
        lower.gate.set()
        assert future.result(10) == 256
        manager.release_prefetched("slow")
        seen.append(foreground.is_busy())
        # answered on the caller's thread: busy only while it ran
        assert manager.lookup_and_prefetch("mem", [key(2)], [256]).result(0) == 256
        manager.release_prefetched("mem")
        seen.append(foreground.is_busy())
    finally:
        lower.gate.set()
        manager.close()
    assert seen == [True, False, False]


def test_the_fs_tier_writes_no_entry_while_a_request_is_served(tmp_path, long_yield) -> None:
    from lmkv.memory import MemoryAllocator
    from tests.backends.test_fs import chunk, make_fs
    from tests.backends.test_fs import key as fs_key

    arena = MemoryAllocator(16 << 20, pin_memory=False)
    fs = make_fs(str(tmp_path), arena)
    obj = arena.allocate(chunk(3).shape, chunk(3).dtype)
    obj.tensor.copy_(chunk(3))
    try:
        with foreground.busy():
            batch = fs.batched_submit_put([fs_key(3)], [obj])
            time.sleep(0.1)
            assert not batch.done() and not fs.contains(fs_key(3))
        assert batch.result(10) == 1 and fs.contains(fs_key(3))
    finally:
        obj.ref_down()
        fs.close()


def test_the_prefault_thread_faults_nothing_while_a_request_is_served(long_yield) -> None:
    import lmkv.memory as memory
    from lmkv.memory import MemoryAllocator

    if memory._MADVISE is None:
        pytest.skip("no libc madvise here")
    with foreground.busy():
        alloc = MemoryAllocator(64 << 20, pin_memory=False, prefault_ahead=16 << 20)
        obj = alloc.allocate((1 << 20,), torch.uint8)
        assert alloc.prefaulter is not None
        time.sleep(0.1)
        assert alloc.prefaulter.done == 0
    assert alloc.prefaulter.wait(30)
    obj.ref_down()


def test_the_config_sets_the_bound_and_zero_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmkv import load_config

    monkeypatch.setattr(foreground, "MAX_YIELD_S", foreground.MAX_YIELD_S)  # restored after
    config = load_config(env={"LMKV_BACKGROUND_YIELD_MS": "0"},
                         overrides={"lmkv.tiers": [{"type": "cpu",
                                                    "options": {"max_bytes": "16MiB"}}]})
    manager = StorageManager.from_config(config)
    manager.close()
    assert foreground.MAX_YIELD_S == 0
    with foreground.busy():
        assert foreground.wait_idle() is False  # at once: it does not wait
    manager = StorageManager.from_config(load_config(env={}, overrides={
        "lmkv.background_yield_ms": 20, "lmkv.tiers": config.model_dump()["tiers"]}))
    manager.close()
    assert abs(foreground.MAX_YIELD_S - 0.02) < 1e-9
    assert load_config(env={}).background_yield_ms == 200


def test_a_manager_closed_with_lookups_queued_leaves_nothing_busy() -> None:
    from tests.storage.test_prefetch import Gated

    upper, lower = cpu(), cpu(Gated)
    lower.gate = threading.Event()
    manager = StorageManager([upper, lower])
    obj = lower.allocate(SHAPE, torch.float32)
    lower.batched_submit_put([key(5)], [obj]).result()
    obj.ref_down()
    try:
        for i in range(6):  # more than the prefetch threads: some wait, never run
            manager.lookup_and_prefetch(f"q{i}", [key(5)], [256])
        assert foreground.is_busy()
        manager.close(timeout=0.2)  # the queued ones are cancelled, never run
    finally:
        lower.gate.set()  # the running ones finish
        manager.close()
    deadline = time.monotonic() + 10
    while foreground.is_busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not foreground.is_busy()
