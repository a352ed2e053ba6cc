"""The shared-memory arena: the cpu tier's option and placement, the allocator's buffer,
attaching."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmkv.backend import ArenaPlacement, BackendContext
from lmkv.memory import MemoryAllocator
from lmkv.memory.shm import SharedMemoryUnavailable, SharedSegment
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy
from tests.server.procs import REPO, child_env, lmkv_segments


def test_the_cpu_tier_places_its_arena_in_a_segment_and_unlinks_it_at_close() -> None:
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=True),
                      BackendContext(eviction_policy=LRUPolicy()))
    segment = tier.shared_segment
    assert segment is not None and segment.name in lmkv_segments()
    obj = tier.allocate((4, 64), torch.float32)
    obj.tensor.fill_(3.5)
    peer = SharedSegment.attach(segment.name)
    view = peer.tensor[obj.offset:obj.offset + obj.nbytes].view(torch.float32)
    assert torch.all(view == 3.5)  # another mapping sees the arena's bytes
    obj.ref_down()
    peer.close()
    tier.close()
    assert segment.name not in lmkv_segments()


def test_the_default_cpu_tier_has_no_segment() -> None:
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20),
                      BackendContext(eviction_policy=LRUPolicy()))
    assert tier.shared_segment is None
    tier.close()


def test_the_cpu_tier_honours_the_arena_placement_it_is_handed() -> None:
    shared = BackendContext(eviction_policy=LRUPolicy(), arena=ArenaPlacement.SHARED)
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20), shared)
    assert tier.shared_segment is not None and tier.shared_segment.name in lmkv_segments()
    tier.close()
    # the tier's own option wins over the placement, either way
    private = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=False), shared)
    assert private.shared_segment is None
    private.close()
    demanded = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=True),
                          BackendContext(eviction_policy=LRUPolicy()))
    assert demanded.shared_segment is not None
    demanded.close()


def test_the_allocator_uses_a_given_buffer_and_checks_it() -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    alloc = MemoryAllocator(1 << 16, buffer=buffer)
    obj = alloc.allocate((16,), torch.uint8)
    obj.tensor.fill_(9)
    assert buffer[obj.offset:obj.offset + 16].eq(9).all()
    obj.ref_down()
    with pytest.raises(ValueError, match="at least"):
        MemoryAllocator(1 << 16, buffer=torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        MemoryAllocator(1024, buffer=torch.zeros(1024, dtype=torch.float32))


def test_a_process_that_attaches_and_exits_leaves_the_segment_alone() -> None:
    segment = SharedSegment.create(1 << 16)
    try:
        code = ("from lmkv.memory.shm import SharedSegment; "
                f"s = SharedSegment.attach({segment.name!r}); s.tensor[0] = 42; s.close()")
        subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), cwd=REPO,
                       timeout=60)
        assert segment.name in lmkv_segments()
        assert int(segment.tensor[0]) == 42
    finally:
        segment.close()
    assert segment.name not in lmkv_segments()


def test_attaching_a_missing_segment_is_unavailable() -> None:
    with pytest.raises(SharedMemoryUnavailable):
        SharedSegment.attach("lmkv-no-such-segment")


def test_a_segment_larger_than_dev_shm_is_refused_up_front() -> None:
    with pytest.raises(SharedMemoryUnavailable, match="free"):
        SharedSegment.create(1 << 60)
