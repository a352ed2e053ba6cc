"""The C accelerator of chunk buffers and arenas (``lmkv._ext._memory``) against its
pure-Python twin in ``lmkv.memory``: the same answers, op for op, and the whole
memory and cpu-tier suites passing on the Python one too."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch

import lmkv.memory as memory
from lmkv.base.errors import RefCountError
from lmkv.memory import MemoryAllocator, MemoryObj, _PyArenaCore, _PyObjCore

ROOT = Path(__file__).resolve().parents[2]
native = pytest.mark.skipif(not memory.NATIVE, reason="the C accelerator is not built here")


def test_the_whole_memory_and_cpu_tier_suites_pass_without_the_accelerator() -> None:
    """Where the extensions cannot be built, lmkv runs on their Python twins: the
    allocator's, the cpu and fs tiers', their indexes' and the policies' tests, in
    a process that cannot import them."""
    code = (
        "import sys; sys.modules['lmkv._ext._memory'] = None\n"
        "sys.modules['lmkv._ext._slots'] = None\n"
        "import lmkv.memory as m; assert not m.NATIVE, 'the accelerator was imported'\n"
        "assert m.MemoryObj.__mro__[1] is m._PyObjCore\n"
        "import lmkv.keys.slots as s; assert s.SlotKeys is s.PySlotKeys\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/memory/test_allocator.py',"
        " 'tests/backends/test_cpu.py', 'tests/backends/test_cpu_index.py',"
        " 'tests/keys/test_slots.py', 'tests/backends/test_fs.py', 'tests/policies',"
        " 'tests/memory/test_native.py::test_counts_stay_right_under_threads',"
        " 'tests/memory/test_native.py::test_bad_counts_are_reported_not_applied']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_the_accelerator_is_built_where_a_compiler_is() -> None:
    """setup.py builds it when a C compiler is present (the development machine and
    CI have one): its tests must not all skip there unnoticed."""
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is None:
        pytest.skip("no C compiler here: lmkv runs on the Python twin")
    assert memory.NATIVE, "a compiler is here but lmkv._ext._memory was not built"


class _PyObj(_PyObjCore):
    __slots__ = ()


@native
def test_the_c_free_list_answers_as_the_python_one_op_for_op() -> None:
    """Random allocations and frees of mixed sizes (double frees and frees out of
    the arena among them) on both cores: the same offsets, answers, blocks and
    counts after every step."""
    rng = random.Random(7)
    capacity = 64 * 256
    alloc = MemoryAllocator(capacity, pin_memory=False)
    layouts = [alloc.layout((n,), torch.uint8) for n in (1, 256, 300, 700, 1024, 4096)]
    c_core = memory._native.ArenaCore(alloc, capacity, MemoryObj, {})
    py_core = _PyArenaCore(alloc, capacity, _PyObj, {})
    held: list[tuple[int, int]] = []
    for _ in range(4000):
        if held and rng.random() < 0.45:
            start, size = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.05:
                held.append((start, size))  # freed twice, later
            assert c_core.free(start, size) == py_core.free(start, size)
        elif rng.random() < 0.03:
            start = rng.randrange(-256, capacity + 256)
            size = rng.choice((0, 256, 512, capacity))
            assert c_core.free(start, size) == py_core.free(start, size)
        else:
            layout = rng.choice(layouts)
            a, b = c_core.allocate_layout(layout), py_core.allocate_layout(layout)
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.offset, a.nbytes, a.ref_count) == (b.offset, b.nbytes, b.ref_count)
                held.append((a.offset, a.nbytes))
        assert c_core.blocks() == py_core.blocks()
        assert c_core.largest == py_core.largest
        assert (c_core.used_bytes, c_core.live_objects, c_core.peak_live, c_core.high) == (
            py_core.used_bytes, py_core.live_objects, py_core.peak_live, py_core.high)


@native
def test_a_layout_larger_than_any_arena_is_no_room_not_an_error() -> None:
    alloc = MemoryAllocator(1 << 16, pin_memory=False)
    huge = memory.Layout(-1, torch.uint8, torch.Size([2**70]), 2**70, 2**70)
    assert alloc._core.allocate_layout(huge) is None
    assert alloc.allocate((2**20,), torch.uint8) is None
    assert alloc.used_bytes == 0 and alloc.live_objects == 0


def test_bad_counts_are_reported_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "strict_refcounts", True)
    alloc = MemoryAllocator(1 << 16, pin_memory=False)
    obj = alloc.allocate((64,), torch.float32)
    assert obj is not None
    obj.ref_down()
    with pytest.raises(RefCountError, match="ref_down below zero"):
        obj.ref_down()
    with pytest.raises(RefCountError, match="released buffer"):
        obj.ref_up()
    with pytest.raises(RefCountError, match="released buffer"):
        memory.add_refs([obj])
    with pytest.raises(RefCountError, match="unpin below zero"):
        obj.unpin()
    assert obj.ref_count == 0 and obj.pin_count == 0
    assert alloc.used_bytes == 0 and alloc.live_objects == 0
    with pytest.raises(RefCountError, match="double free"):
        alloc.free_block(obj.offset, obj.nbytes)
    pinned = alloc.allocate((64,), torch.float32)
    assert pinned is not None
    pinned.pin()
    with pytest.raises(RefCountError, match="freed while pinned"):
        pinned.ref_down()
    assert alloc.live_objects == 1  # reported before it went back: still counted


def test_counts_stay_right_under_threads() -> None:
    """Four threads taking and giving back references on shared buffers and
    allocating and freeing their own, at once: every count ends where it began."""
    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    shared = [alloc.allocate((256,), torch.float32) for _ in range(32)]
    assert all(obj is not None for obj in shared)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(3000):
                objs = rng.sample(shared, 4)
                if rng.random() < 0.5:
                    memory.add_refs(objs)
                    memory.release(objs)
                else:
                    for obj in objs:
                        assert obj.ref_up()
                    for obj in objs:
                        obj.ref_down()
                mine = alloc.allocate((rng.choice((16, 256, 1000)),), torch.float32)
                if mine is not None:
                    mine.ref_down()
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert all(obj.ref_count == 1 for obj in shared)
    assert alloc.live_objects == 32 and alloc.used_bytes == 32 * 1024
    memory.release(shared)
    assert alloc.live_objects == 0 and alloc.free_blocks() == [(0, alloc.capacity_bytes)]


def test_a_buffer_made_over_a_block_is_the_arenas_view() -> None:
    alloc = MemoryAllocator(1 << 16, pin_memory=False)
    obj = alloc.allocate((4, 8), torch.bfloat16)
    assert obj is not None
    obj.tensor.fill_(3)
    again = alloc.reuse(obj.offset, obj._layout)
    assert again.ref_count == 1 and again.nbytes == obj.nbytes
    assert again.tensor.data_ptr() == obj.tensor.data_ptr()
    assert torch.all(again.tensor == 3) and again.tensor.shape == (4, 8)
    assert isinstance(again, MemoryObj) and again.allocator is alloc
    detached = MemoryObj(torch.zeros(3))
    assert detached.ref_up() and detached.ref_count == 2
    detached.ref_down()
    detached.ref_down()
    assert detached.ref_count == 0  # no arena: nothing to give back


@native
def test_callbacks_that_change_the_list_do_not_move_the_loop() -> None:
    """``release`` of a list whose items' ``ref_down`` (a duck-typed one) empties it:
    each item of the list as given is released once, nothing read past it."""
    alloc = MemoryAllocator(1 << 16, pin_memory=False)
    objs = [alloc.allocate((16,), torch.float32) for _ in range(3)]

    class Meddler:
        def __init__(self, victim: list) -> None:
            self.victim = victim

        def ref_down(self) -> None:
            self.victim.clear()
            self.victim.extend([0] * 1000)

    items: list = []
    items += [Meddler(items), *objs]
    memory.release(items)
    assert all(obj.ref_count == 0 for obj in objs) and alloc.live_objects == 0


@native
def test_a_core_refuses_what_no_arena_holds() -> None:
    alloc = MemoryAllocator(1 << 16, pin_memory=False)
    core = alloc._core
    assert core.free(2**62, 2**62) is False  # (their sum overflows 64 bits)
    assert core.free(-256, 512) is False and core.free(0, 0) is False
    assert (core.used_bytes, core.live_objects, core.blocks()) == (0, 0, [(0, 1 << 16)])
    with pytest.raises(ValueError, match="negative"):
        core.make(0, memory.Layout(0, torch.uint8, torch.Size([1]), 1, -5))
    for made in (memory._native.ArenaCore.__new__(memory._native.ArenaCore),):
        with pytest.raises(RuntimeError, match="__init__"):
            made.allocate((1,), torch.uint8)
    bare = memory._native.or_else.__new__(memory._native.or_else)
    with pytest.raises(RuntimeError, match="__init__"):
        bare(1)
    assert memory.or_else(lambda x: None, lambda x: x + 1)(1) == 2
    assert memory.or_else(lambda x: x, lambda x: x + 1)(1) == 1
