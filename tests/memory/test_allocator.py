from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from lmkv.base.errors import RefCountError
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


def test_a_shape_no_view_takes_leaks_no_block() -> None:
    import pytest

    from lmkv.memory import MemoryAllocator

    arena = MemoryAllocator(1 << 20, pin_memory=False)
    for _ in range(10_000):  # more than the arena's 4096 blocks
        with pytest.raises(ValueError, match="no buffer of shape"):
            arena.allocate((2**40, 2**40, 0), torch.float16)
    assert (arena.used_bytes, arena.live_objects) == (0, 0)
    assert arena.free_blocks() == [(0, arena.capacity_bytes)]
    obj = arena.allocate((4, 64), torch.float16)
    assert obj is not None
    obj.ref_down()


@pytest.mark.slow  # seconds of allocations
def test_the_view_cache_stays_bounded_with_mixed_chunk_sizes() -> None:
    from lmkv import memory

    arena = memory.MemoryAllocator(64 << 20, pin_memory=False)
    live = []
    for i in range(200_000):  # new (offset, shape) pairs without end
        obj = arena.allocate((1 + i % 97, 8 + i % 13), torch.float16)
        live.append(obj)
        if len(live) > 64:
            live.pop(0).ref_down()
    assert arena.view_cache_bytes <= memory.VIEW_CACHE_BYTES
    assert len(arena._views) <= max(1024, 2 * 65)  # twice the buffers ever live at once
    for obj in live:
        obj.ref_down()


def test_uniform_chunks_keep_their_views_cached() -> None:
    from lmkv import memory

    arena = memory.MemoryAllocator(8 << 20, pin_memory=False)
    objs = [arena.allocate((64, 64), torch.float16) for _ in range(1000)]
    first = [obj.tensor for obj in objs]
    views = len(arena._views)
    for obj in objs:
        obj.ref_down()
    again = [arena.allocate((64, 64), torch.float16) for _ in range(1000)]
    assert all(obj.tensor is view for obj, view in zip(again, first, strict=True))
    assert len(arena._views) == views == 1000  # every slot reused its cached view
    for obj in again:
        obj.ref_down()


def _resident_bytes(alloc: MemoryAllocator) -> int:
    """Resident bytes of exactly the arena's pages, from ``mincore``. (Not the
    mapping's Rss in /proc/self/smaps: the kernel merges neighbouring anonymous
    mappings into one, so that Rss counts other memory's pages too.)"""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = alloc.arena.data_ptr()
    assert start % page == 0
    pages = (alloc.capacity_bytes + page - 1) // page
    vec = ctypes.create_string_buffer(pages)
    if libc.mincore(start, pages * page, vec) != 0:
        raise AssertionError(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return sum(b & 1 for b in vec.raw) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux's")
def test_a_private_arena_is_faulted_in_ahead_of_the_allocator() -> None:
    alloc = MemoryAllocator(64 << 20, pin_memory=False, prefault_ahead=16 << 20)
    assert alloc.prefaulter is not None
    assert _resident_bytes(alloc) < 1 << 20  # nothing before the arena is used
    obj = alloc.allocate((1 << 20,), torch.uint8)
    obj.tensor.fill_(7)
    assert alloc.prefaulter.wait(30)
    if alloc.prefaulter.done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert alloc.prefaulter.done == 17 << 20  # 16 MiB past the end of the first buffer
    assert (17 << 20) <= _resident_bytes(alloc) < 24 << 20
    assert torch.all(obj.tensor == 7)  # faulting in never writes
    small = alloc.allocate((4096,), torch.uint8)  # not a step further: no new work
    assert alloc.prefaulter.wait(30) and alloc.prefaulter.done == 17 << 20
    small.ref_down()
    obj.ref_down()


def _prefaulting_allocator() -> MemoryAllocator:
    """An arena faulted in ahead (skips where this kernel cannot)."""
    import lmkv.memory as memory

    if memory._MADVISE is None:
        pytest.skip("no libc madvise here")
    alloc = MemoryAllocator(64 << 20, pin_memory=False, prefault_ahead=16 << 20)
    obj = alloc.allocate((1 << 20,), torch.uint8)
    assert alloc.prefaulter is not None and alloc.prefaulter.wait(30)
    obj.ref_down()
    if alloc.prefaulter.done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    return alloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux's")
def test_prefaulting_lets_the_other_threads_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faulting pages in takes the CPU, never the GIL: ``mmap.madvise`` held it for
    the whole call, and inside vLLM that stalled the lookup's reads for tens of ms
    (every other thread waited for each 8 MiB step). Another thread, woken as
    the call starts, must run within its first half (it could only run after
    the call if the GIL were held)."""
    import lmkv.memory as memory

    _prefaulting_allocator()
    step = 256 << 20  # one long call: about 0.1 s
    monkeypatch.setattr(memory, "PREFAULT_STEP", step)
    go = threading.Event()
    ran_at: list[float] = []

    def other() -> None:
        go.wait()
        ran_at.append(time.perf_counter())

    real = memory._MADVISE
    assert real is not None
    spans: list[tuple[float, float]] = []

    def madvise(addr: int, length: int, advice: int) -> int:
        if length != step:  # another arena's work, or the last page
            return real(addr, length, advice)
        t0 = time.perf_counter()
        go.set()
        code = real(addr, length, advice)
        spans.append((t0, time.perf_counter()))
        return code

    monkeypatch.setattr(memory, "_MADVISE", madvise)
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    alloc = MemoryAllocator(512 << 20, pin_memory=False, prefault_ahead=step)
    obj = alloc.allocate((4096,), torch.uint8)
    assert alloc.prefaulter is not None and alloc.prefaulter.wait(60)
    go.set()
    thread.join(10)
    assert alloc.prefaulter.done == step + 4096  # one long step, then a page
    assert len(spans) == 1 and ran_at
    (t0, t1), = spans
    assert ran_at[0] - t0 < (t1 - t0) / 2, (ran_at[0] - t0, t1 - t0)
    obj.ref_down()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux's")
def test_allocating_never_starts_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Thread.start`` waits for the new thread to run, which under a busy GIL took
    a lookup's read tens of ms: the process's one prefault thread takes the work."""
    _prefaulting_allocator()
    alloc = MemoryAllocator(128 << 20, pin_memory=False, prefault_ahead=16 << 20)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    objs = [alloc.allocate((8 << 20,), torch.uint8) for _ in range(8)]
    assert alloc.prefaulter is not None and alloc.prefaulter.wait(30)
    assert alloc.prefaulter.done == 80 << 20  # 16 MiB past the 64 MiB handed out
    assert started == []
    for obj in objs:
        obj.ref_down()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and madvise are Linux's")
def test_a_forked_child_prefaults_with_a_thread_of_its_own() -> None:
    _prefaulting_allocator()  # the parent's prefault thread runs
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here
        code = 1
        try:
            alloc = MemoryAllocator(64 << 20, pin_memory=False, prefault_ahead=16 << 20)
            alloc.allocate((1 << 20,), torch.uint8)
            if alloc.prefaulter is not None and alloc.prefaulter.wait(30) \
                    and alloc.prefaulter.done == 17 << 20:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and madvise are Linux's")
def test_an_arena_inherited_across_a_fork_is_prefaulted_in_the_child() -> None:
    _prefaulting_allocator()
    alloc = MemoryAllocator(512 << 20, pin_memory=False, prefault_ahead=256 << 20)
    alloc.allocate((4096,), torch.uint8)  # its prefault may be running as we fork
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            assert alloc.prefaulter is not None
            alloc.allocate((300 << 20,), torch.uint8)  # a step past the parent's target
            if alloc.prefaulter.wait(30) and alloc.prefaulter.done == 512 << 20:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_no_prefault_unless_asked_or_for_a_given_buffer() -> None:
    assert MemoryAllocator(1 << 20, pin_memory=False).prefaulter is None
    given = torch.zeros(1 << 20, dtype=torch.uint8)
    assert MemoryAllocator(1 << 20, buffer=given, prefault_ahead=1 << 20).prefaulter is None


def test_a_buffer_of_the_arena_keeps_no_tensor_of_its_own() -> None:
    """A tier of many small chunks pays a few fields per chunk, not a tensor (about
    1 KiB each): ``tensor`` is the arena's view of the buffer's slot."""
    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    objs = [alloc.allocate((4, 8), torch.float16) for _ in range(8)]
    for i, obj in enumerate(objs):
        assert obj._tensor is None
        obj.tensor.fill_(i)
        assert obj.shape == (4, 8) and obj.dtype == torch.float16
        assert obj.tensor.data_ptr() == alloc.arena.data_ptr() + obj.offset
    assert [int(obj.tensor[0, 0]) for obj in objs] == list(range(8))
    assert objs[0].shape is objs[1].shape  # the layout is interned
    alloc._views.clear()  # a view made again sees the same bytes
    assert [int(obj.tensor.sum()) for obj in objs] == [32 * i for i in range(8)]
    for obj in objs:
        obj.ref_down()


def test_layouts_past_the_interned_ones_still_get_their_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lmkv import memory

    monkeypatch.setattr(memory, "MAX_LAYOUTS", 2)
    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    objs = [alloc.allocate((n,), torch.int32) for n in range(1, 6)]
    assert len(alloc._layouts) == 2  # shapes from outside without end: not interned
    for n, obj in enumerate(objs, 1):
        obj.tensor.fill_(n)
        assert obj.shape == (n,) and int(obj.tensor.sum()) == n * n
    for obj in objs:
        obj.ref_down()
    assert alloc.used_bytes == 0


def test_a_memory_obj_made_by_hand_over_an_arena_view_gets_the_arenas_layout() -> None:
    """``MemoryObj(view, allocator, offset)`` (a view of an arena's buffer, made
    by hand): its layout is the allocator's, so a tier that keeps only its
    offset and layout rebuilds the same buffer, and gives back all of it."""
    from lmkv.memory import MemoryObj

    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    taken = alloc.allocate((8, 128), torch.float16)
    by_hand = MemoryObj(taken.tensor, alloc, taken.offset)
    assert by_hand.nbytes == taken.nbytes == 2048 and by_hand._layout is taken._layout
    assert alloc.view_at(by_hand.offset, by_hand._layout).data_ptr() == taken.tensor.data_ptr()
    taken.ref_down()
    assert alloc.used_bytes == 0
