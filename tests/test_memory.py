from __future__ import annotations

import pytest
import torch

from lmkv.errors import RefCountError
from lmkv.memory import ALIGNMENT, MemoryAllocator


def test_allocations_never_exceed_the_budget() -> None:
    alloc = MemoryAllocator(10 * 4096)
    objs = []
    while (obj := alloc.allocate((1024,), torch.float32)) is not None:
        objs.append(obj)
    assert len(objs) == 10
    assert alloc.used_bytes == alloc.capacity_bytes
    assert alloc.allocate((1,), torch.uint8) is None
    for obj in objs:
        obj.ref_down()
    assert alloc.used_bytes == 0 and alloc.live_objects == 0


def test_buffers_do_not_overlap_and_hold_their_data() -> None:
    alloc = MemoryAllocator(1 << 20)
    objs = [alloc.allocate((100 + i,), torch.float16) for i in range(50)]
    for i, obj in enumerate(objs):
        obj.tensor.fill_(i)
    for i, obj in enumerate(objs):
        assert torch.all(obj.tensor == i)
        assert obj.offset % ALIGNMENT == 0


def test_free_blocks_coalesce() -> None:
    alloc = MemoryAllocator(8 * 1024)
    objs = [alloc.allocate((1024,), torch.uint8) for _ in range(8)]
    for obj in objs[1::2]:
        obj.ref_down()
    assert alloc.allocate((2048,), torch.uint8) is None  # fragmented
    for obj in objs[0::2]:
        obj.ref_down()
    big = alloc.allocate((8 * 1024,), torch.uint8)
    assert big is not None and big.offset == 0


def test_reference_counting_frees_at_zero() -> None:
    alloc = MemoryAllocator(4096)
    obj = alloc.allocate((256,), torch.uint8)
    obj.ref_up()
    obj.ref_down()
    assert alloc.live_objects == 1
    obj.ref_down()
    assert alloc.live_objects == 0


def test_double_release_raises_in_tests() -> None:
    alloc = MemoryAllocator(4096)
    obj = alloc.allocate((256,), torch.uint8)
    obj.ref_down()
    with pytest.raises(RefCountError):
        obj.ref_down()
    other = alloc.allocate((256,), torch.uint8)
    with pytest.raises(RefCountError):
        other.unpin()


def test_pin_counts() -> None:
    alloc = MemoryAllocator(4096)
    obj = alloc.allocate((256,), torch.uint8)
    assert obj.is_evictable
    obj.pin()
    assert not obj.is_evictable
    obj.unpin()
    obj.ref_up()
    assert not obj.is_evictable  # someone besides the tier holds it
    obj.ref_down()
    obj.ref_down()


@pytest.mark.parametrize("huge_pages", [False, True])
def test_unpinned_arena_is_page_aligned_and_usable(huge_pages: bool) -> None:
    alloc = MemoryAllocator(8 << 20, pin_memory=False, huge_pages=huge_pages)
    assert alloc.arena.data_ptr() % 4096 == 0
    obj = alloc.allocate((256, 1024), torch.float32)
    assert obj is not None
    obj.tensor.copy_(torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
    assert obj.tensor[255, 1023].item() == 256 * 1024 - 1
    obj.ref_down()
    assert alloc.used_bytes == 0


@pytest.mark.parametrize("shape", [[1 << 40, 1 << 40, 0], [1 << 63, 0], [1 << 62, 1 << 62, 0]])
def test_a_shape_torch_refuses_gives_its_block_back(shape) -> None:
    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    for _ in range(5000):  # more than the arena's blocks
        with pytest.raises((RuntimeError, TypeError, ValueError)):
            alloc.allocate(shape, torch.uint8)
    assert alloc.used_bytes == 0 and alloc.live_objects == 0
    assert alloc.free_blocks() == [(0, alloc.capacity_bytes)]
