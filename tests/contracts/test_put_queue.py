"""``lmkv.contracts.put_queue.PutQueue``: the bounded asynchronous put queue of remote tiers
(lmkv-redis and lmkv-mooncake run it against real servers in their own tests)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from lmkv.contracts.faults import TierCounters, TierFaults
from lmkv.contracts.put_queue import PutQueue
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, MemoryObj

META = KeyMeta("put-queue-test", 1, 0, "float32", "l2thd")


class Queue(PutQueue):
    def __init__(self, max_pending_bytes: int) -> None:
        super().__init__(TierFaults(TierCounters(), "test tier"), max_pending_bytes, "test-put")
        self.up = True
        self.gate = threading.Event()
        self.seen: list[list[int]] = []  # each batch's refcounts while written

    @property
    def usable(self) -> bool:
        return self.up

    def _write(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        self.gate.wait(10)
        self.seen.append([obj.ref_count for obj in objs])
        if keys and keys[0].chunk_hash == b"\xff" * 32:
            raise RuntimeError("a bug in the tier")
        return len(keys)


def _chunks(arena: MemoryAllocator, n: int, first: int = 0
            ) -> tuple[list[CacheKey], list[MemoryObj]]:
    keys = [CacheKey(META, (first + i).to_bytes(32, "little")) for i in range(n)]
    objs = [arena.allocate((1, 2, 4, 1, 8), torch.float32) for _ in range(n)]
    return keys, objs


def test_puts_run_in_the_background_holding_their_chunks_until_written() -> None:
    arena = MemoryAllocator(1 << 20, pin_memory=False)
    queue = Queue(max_pending_bytes=1 << 20)
    keys, objs = _chunks(arena, 3)
    future = queue.submit(keys, objs)
    assert not future.done() and queue.pending_bytes == sum(o.nbytes for o in objs)
    queue.gate.set()
    assert future.result(10) == 3
    assert queue.seen == [[2, 2, 2]]  # the queue's reference on top of the caller's
    assert [o.ref_count for o in objs] == [1, 1, 1] and queue.pending_bytes == 0
    queue.close(1)


def test_a_full_queue_a_closed_one_and_an_unusable_tier_drop_and_count() -> None:
    arena = MemoryAllocator(1 << 20, pin_memory=False)
    keys, objs = _chunks(arena, 2)
    queue = Queue(max_pending_bytes=objs[0].nbytes)
    first = queue.submit(keys[:1], objs[:1])  # held at the gate
    assert queue.submit(keys[1:], objs[1:]).result(1) == 0  # over the cap: dropped
    assert queue.counters.dropped_writes == 1
    queue.gate.set()
    assert first.result(10) == 1
    queue.up = False
    assert queue.submit(keys[1:], objs[1:]).result(1) == 0
    queue.up = True
    queue.close(1)
    assert queue.submit(keys[1:], objs[1:]).result(1) == 0
    assert queue.counters.dropped_writes == 3
    assert [o.ref_count for o in objs] == [1, 1]


def test_a_bug_in_write_reaches_the_caller_and_the_chunks_are_released() -> None:
    arena = MemoryAllocator(1 << 20, pin_memory=False)
    queue = Queue(max_pending_bytes=1 << 20)
    queue.gate.set()
    bad = [CacheKey(META, b"\xff" * 32)]
    _, objs = _chunks(arena, 1)
    with pytest.raises(RuntimeError, match="a bug in the tier"):
        queue.submit(bad, objs).result(10)
    assert objs[0].ref_count == 1 and queue.pending_bytes == 0
    with pytest.raises(ValueError, match="2 keys for 1 chunks"):
        queue.submit(bad * 2, objs)
    queue.close(1)
