"""Chunk buffers (MemoryObj) carved out of one arena with a hard byte budget.

One large uint8 tensor is allocated up front (pinned host memory when CUDA is
present); chunk buffers are views into it. Allocation is first-fit over a
sorted, coalescing free list, so a full arena means "evict and retry", never
an allocation past the budget. Typed views of recurring slots are cached,
which keeps the per-chunk cost of small chunks near zero.

The view cache is bounded by the memory its views take (about 1 KiB of tensor
metadata each): at most twice as many views as buffers were ever live at once
(what uniform chunks reuse), never more than ``VIEW_CACHE_BYTES`` or a
32nd of the arena (a tiny chunk costs less than its view). A buffer
holds no view of its own (``MemoryObj.tensor`` asks the cache). Mixed chunk
sizes create new (offset, shape) pairs without end; the oldest views go first.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import math
import mmap
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from lmkv.base import affinity
from lmkv.base.errors import RefCountError

logger = logging.getLogger(__name__)

ALIGNMENT = 256
# What one cached view costs (tensor object, its impl and sizes, the dict entry):
# measured at about 1.1 KiB on CPython 3.12 / torch 2.x.
VIEW_COST_BYTES = 1152
VIEW_CACHE_BYTES = 16 << 20
#: Distinct (dtype, shape) layouts an allocator interns; more get views not cached.
_LAYOUT_BITS = 12
MAX_LAYOUTS = 1 << _LAYOUT_BITS
_VIEW_CACHE_MIN = 1024  # views kept whatever the live count (a small working set)

# madvise(MADV_POPULATE_WRITE), Linux 5.14: fault pages in as a write would, without
# writing (so never racing with a chunk being filled there). Python 3.11's mmap has
# no name for it (23 is Linux's value); elsewhere there is no such advice.
_POPULATE_WRITE_KNOWN = hasattr(mmap, "MADV_POPULATE_WRITE") or sys.platform.startswith("linux")
_MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFAULT_STEP = 8 << 20  # bytes per madvise call of the prefault thread


def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes, which lets go of the GIL for the call.
    (``mmap.madvise`` holds it: faulting in 8 MiB then stalls every other thread
    of the process, the lookup's and the engine's, for milliseconds.)"""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = libc_madvise() if _POPULATE_WRITE_KNOWN else None

# Tests turn this on so a double release raises; in production it is logged loudly.
strict_refcounts = False


def _refcount_bug(message: str) -> None:
    if strict_refcounts:
        raise RefCountError(message)
    logger.error("lmkv bug: %s", message)


#: Where a chunk buffer comes from: ``allocate(shape, dtype)``, None when there is no room.
Allocate = Callable[[Sequence[int], torch.dtype], "MemoryObj | None"]


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how keys, messages and logs name a dtype."""
    return str(dtype).removeprefix("torch.")


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


MAX_CHUNK_NDIM = 8


def shape_problem(shape: Sequence[int], itemsize: int, max_bytes: int) -> str | None:
    """What is wrong with a chunk ``shape`` that comes from outside (a frame, a
    request), in one line naming what is allowed; None when it is fine: 1 to
    MAX_CHUNK_NDIM dimensions, each at least 1, at most ``max_bytes`` bytes.

    Checked before anything is allocated: a zero dimension hides overflowing ones
    from the product (``[2**40, 2**40, 0]`` is 0 bytes), and torch refuses such a
    shape only after an arena block was taken.
    """
    text = str(list(shape))
    text = text if len(text) <= 80 else text[:77] + "..."
    if not 1 <= len(shape) <= MAX_CHUNK_NDIM:
        return (f"shape {text}: {len(shape)} dimensions; allowed: 1 to {MAX_CHUNK_NDIM}")
    nbytes = itemsize
    for dim in shape:
        if dim < 1:
            return f"shape {text}: dimension {dim}; allowed: 1 or more"
        nbytes *= dim
        if nbytes > max_bytes:  # stops before the product can grow huge
            return f"shape {text}: larger than {max_bytes} bytes, the most allowed"
    return None


class Layout(NamedTuple):
    """A chunk buffer's dtype and shape, interned per allocator (``ident``), its
    bytes and the bytes it takes in its allocator's arena (``size``: aligned)."""

    ident: int
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int = 0
    size: int = 0


class _PyObjCore:
    """A chunk buffer's fields and reference counts, in Python: what
    ``lmkv._ext._memory.MemoryObjCore`` does where the accelerator is not built
    (the same behaviour; counts change under the allocator's lock)."""

    __slots__ = ("_allocator", "_layout", "_tensor", "nbytes", "offset", "pin_count",
                 "ref_count")

    _allocator: MemoryAllocator | None
    _layout: Layout
    _tensor: torch.Tensor | None
    nbytes: int
    offset: int
    pin_count: int
    ref_count: int

    @property
    def tensor(self) -> torch.Tensor:
        tensor = self._tensor
        if tensor is not None:
            return tensor
        allocator, layout = self._allocator, self._layout
        # The cached view, looked up here (``view_at`` does the rest): read per chunk.
        tensor = allocator._views.get(self.offset << _LAYOUT_BITS | layout.ident)  # type: ignore[union-attr]
        if tensor is not None and layout.ident >= 0:
            return tensor
        return allocator.view_at(self.offset, layout)  # type: ignore[union-attr]

    def ref_up(self) -> bool:
        """Take a reference; False (a bug, logged or raised) if the buffer was released."""
        lock = self._allocator.lock if self._allocator else _detached_lock
        with lock:
            if self.ref_count <= 0:
                _refcount_bug(f"ref_up on a released buffer at offset {self.offset}")
                return False
            self.ref_count += 1
            return True

    def ref_down(self) -> None:
        """Give a reference back; the buffer returns to its arena at zero."""
        allocator = self._allocator
        lock = allocator.lock if allocator else _detached_lock
        with lock:
            if self.ref_count <= 0:
                _refcount_bug(f"ref_down below zero at offset {self.offset}")
                return
            self.ref_count -= 1
            if self.ref_count == 0 and allocator is not None:
                if self.pin_count:
                    _refcount_bug(f"buffer at offset {self.offset} freed while pinned")
                if not allocator._core.free(self.offset, self.nbytes):
                    _refcount_bug(f"double free of arena block at offset {self.offset}")

    def pin(self) -> None:
        """Pin: never evicted while pinned."""
        lock = self._allocator.lock if self._allocator else _detached_lock
        with lock:
            self.pin_count += 1

    def unpin(self) -> None:
        """Take a pin back."""
        lock = self._allocator.lock if self._allocator else _detached_lock
        with lock:
            if self.pin_count <= 0:
                _refcount_bug(f"unpin below zero at offset {self.offset}")
                return
            self.pin_count -= 1


class _PyArenaCore:
    """An arena's free list (first fit over blocks sorted by start, coalescing) and
    its counts, in Python: what ``lmkv._ext._memory.ArenaCore`` does where the
    accelerator is not built. Every method takes the core's own lock."""

    def __init__(self, allocator: MemoryAllocator, capacity: int, obj_type: type,
                 layouts: dict[tuple, Layout]) -> None:
        self._allocator = allocator
        self._obj_type = obj_type
        self._layouts = layouts
        self._lock = threading.Lock()
        self._starts: list[int] = [0]
        self._sizes: list[int] = [capacity]
        self.capacity = capacity
        self.used_bytes = self.live_objects = self.peak_live = self.high = 0

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        dims = shape if type(shape) is tuple else tuple(shape)
        layout = self._layouts.get((dtype, dims))
        if layout is None:
            layout = self._allocator._layout(dims, dtype)
        return self.allocate_layout(layout)

    def allocate_layout(self, layout: Layout) -> MemoryObj | None:
        size = layout.size
        with self._lock:
            offset = self._take(size)
            if offset < 0:
                return None
            self.used_bytes += size
            self.live_objects += 1
            if self.live_objects > self.peak_live:
                self.peak_live = self.live_objects
            higher = offset + size > self.high
            if higher:
                self.high = offset + size
        obj = self.make(offset, layout)
        prefaulter = self._allocator.prefaulter
        if higher and prefaulter is not None:
            prefaulter.reached(offset + size)
        return obj

    def make(self, offset: int, layout: Layout) -> MemoryObj:
        obj: MemoryObj = _new_obj(self._obj_type)
        obj._tensor, obj._layout, obj._allocator = None, layout, self._allocator
        obj.offset, obj.nbytes, obj.ref_count, obj.pin_count = offset, layout.size, 1, 0
        return obj

    def _take(self, size: int) -> int:
        sizes = self._sizes
        for i, free in enumerate(sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i]
                    del sizes[i]
                else:
                    self._starts[i] = start + size
                    sizes[i] = free - size
                return start
        return -1

    def free(self, start: int, size: int) -> bool:
        """Give a block back (coalescing); False on a double free (an overlap)."""
        with self._lock:
            starts, sizes = self._starts, self._sizes
            i = bisect.bisect_left(starts, start)
            overlaps_next = i < len(starts) and starts[i] < start + size
            overlaps_prev = i > 0 and starts[i - 1] + sizes[i - 1] > start
            if overlaps_next or overlaps_prev or start < 0 or size <= 0 \
                    or start + size > self.capacity:
                return False
            merge_prev = i > 0 and starts[i - 1] + sizes[i - 1] == start
            merge_next = i < len(starts) and start + size == starts[i]
            if merge_prev and merge_next:
                sizes[i - 1] += size + sizes[i]
                del starts[i]
                del sizes[i]
            elif merge_prev:
                sizes[i - 1] += size
            elif merge_next:
                starts[i] = start
                sizes[i] += size
            else:
                starts.insert(i, start)
                sizes.insert(i, size)
            self.used_bytes -= size
            self.live_objects -= 1
            return True

    def blocks(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(zip(self._starts, self._sizes, strict=True))

    @property
    def largest(self) -> int:
        with self._lock:
            return max(self._sizes, default=0)


_new_obj = object.__new__

# The optional C accelerator (setup.py): the same behaviour, without a Python
# frame per allocate, tensor, ref_up or ref_down.
_native: ModuleType | None
try:
    from lmkv._ext import _memory as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

if TYPE_CHECKING:  # the same fields and methods, whichever is used
    _ObjCore = _PyObjCore
    _ArenaCore = _PyArenaCore
else:
    _ObjCore = _native.MemoryObjCore if _native is not None else _PyObjCore
    _ArenaCore = _native.ArenaCore if _native is not None else _PyArenaCore
#: Whether chunk buffers and arenas run on the C accelerator.
NATIVE = _native is not None
#: ``release(objs)``: one reference given back on each (what a reader took).
release: Callable[[Sequence[MemoryObj]], None]
#: ``add_refs(objs)``: one reference taken on each (live buffers only).
add_refs: Callable[[Sequence[MemoryObj]], None]


class MemoryObj(_ObjCore):
    """One chunk buffer: a typed tensor view with a reference and a pin count.

    The creator holds the first reference. Whoever keeps the object (a tier,
    a pending retrieve) takes its own with ``ref_up`` and gives it back with
    ``ref_down``; the buffer returns to its allocator at zero. A pinned
    object is never evicted.

    A buffer of an arena keeps no tensor of its own: ``tensor`` is the
    arena's view of its slot (cached by the allocator), so a tier holding
    many small chunks pays for each a few fields, not a tensor (about 1 KiB).
    """

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor | None, allocator: MemoryAllocator | None = None,
                 offset: int = -1, nbytes: int | None = None,
                 layout: Layout | None = None) -> None:
        """``tensor``: the buffer; None for a buffer of ``allocator``'s arena at
        ``offset`` with ``layout`` (its interned dtype and shape)."""
        if tensor is None:
            if allocator is None or layout is None or nbytes is None:
                raise ValueError("a MemoryObj without a tensor needs its arena, layout "
                                 "and size")
        elif allocator is not None:  # a view of an arena's buffer, made by hand
            layout = allocator._layout(tuple(tensor.shape), tensor.dtype)
            if nbytes is None:
                nbytes = layout.size
        else:
            layout = Layout(-1, tensor.dtype, tensor.shape)
            if nbytes is None:
                nbytes = tensor.numel() * tensor.element_size()
        self._tensor = tensor
        self._layout = layout
        self._allocator = allocator
        self.offset = offset
        self.nbytes = nbytes
        self.ref_count = 1
        self.pin_count = 0

    @property
    def shape(self) -> torch.Size:
        return self._layout.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    @property
    def allocator(self) -> MemoryAllocator | None:
        return self._allocator

    def byte_view(self) -> torch.Tensor:
        """The buffer as flat uint8 (for serializers)."""
        return self.tensor.reshape(-1).view(torch.uint8)

    @property
    def is_evictable(self) -> bool:
        # One reference is the tier's own.
        return self.ref_count <= 1 and self.pin_count == 0

    def __repr__(self) -> str:
        return (f"MemoryObj(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"offset={self.offset}, ref={self.ref_count}, pin={self.pin_count})")


def _release_py(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_down()


def _add_refs_py(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_up()


def _owned_py(objs: Sequence[MemoryObj], allocator: MemoryAllocator) -> bool:
    return all(obj._allocator is allocator and obj.ref_count > 0 for obj in objs)


def _or_else_py(fast: Callable[..., object], slow: Callable[..., object]) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        got = fast(*args, **kwargs)
        return got if got is not None else slow(*args, **kwargs)
    return call


#: ``or_else(fast, slow)``: a callable that answers ``fast(*args)``, or ``slow(*args)``
#: when that is None (a tier's allocate: its arena's, then making room).
or_else: Callable[[Callable[..., object], Callable[..., object]], Callable[..., object]]

#: ``owned(objs, allocator)``: whether every one of ``objs`` is a live buffer of
#: ``allocator`` (none released).
owned: Callable[[Sequence[MemoryObj], MemoryAllocator], bool]

if _native is not None:
    _native.setup(_refcount_bug, _LAYOUT_BITS)
    release, add_refs, owned = _native.release, _native.add_refs, _native.owned
    or_else = _native.or_else
else:  # pragma: no cover - depends on the build
    release, add_refs, owned, or_else = _release_py, _add_refs_py, _owned_py, _or_else_py
_detached_lock = threading.Lock()


def tensor_obj(tensor: torch.Tensor) -> MemoryObj:
    """A MemoryObj around a tensor that belongs to no arena (tests, lower tiers)."""
    return MemoryObj(tensor.contiguous())


def _anonymous_arena(nbytes: int, huge_pages: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """Page-aligned anonymous memory (pages are only taken when touched). With
    ``huge_pages`` it is advised to use transparent huge pages where the kernel
    offers them: large copies out of it take far fewer TLB misses (a 64 MiB copy:
    3.3 ms instead of 5.6 here), but first touches cost more (a fresh arena
    filled from disk was 3-4x slower here)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        with contextlib.suppress(OSError):  # THP off in this kernel: plain pages
            mapping.madvise(advice)
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping


class _Prefaulter:
    """Faults in an anonymous arena's pages ahead of the allocator, off the read path.

    A fresh page costs a fault on first touch (about 0.45 ms per MiB on the
    development VM: 28 ms of a 64 MiB read from a disk tier into a fresh arena).
    First-fit hands out low offsets first, so the pages past the highest offset
    handed out so far are the ones the next new chunks land in: the process's
    prefault thread (``_PrefaultThread``) keeps ``ahead`` bytes past it faulted
    in. A page-locked arena has all its pages from the start; a shared segment
    is left alone.

    Off the read path means two things: ``reached`` (called by ``allocate``)
    only hands work over (``Thread.start`` waits for the new thread to take the
    GIL: the thread is started with the arena, and in a forked child by the
    first ``reached``), and the faulting runs without the GIL (``_MADVISE``),
    so the threads reading chunks in go on meanwhile.
    """

    def __init__(self, mapping: mmap.mmap, base: int, capacity: int, ahead: int) -> None:
        self._mapping = mapping  # kept: the pages at ``base`` stay mapped while faulted in
        self._base = base
        self._capacity = capacity
        self._ahead = ahead
        self._lock = threading.Lock()
        self._target = 0  # fault in up to here
        self.done = 0  # faulted in up to here
        self._running = False
        self._failed = False  # the kernel cannot (older than 5.14): stop trying
        _PREFAULT.ensure()
        _LIVE.add(self)

    def reached(self, end: int) -> None:
        """The allocator handed out memory up to offset ``end``."""
        target = min(self._capacity, (end + self._ahead) // mmap.PAGESIZE * mmap.PAGESIZE)
        with self._lock:
            if self._failed or (target < self._target + PREFAULT_STEP
                                and target < self._capacity) or target <= self._target:
                return
            self._target = target
            if self._running:
                return
            self._running = True
        try:
            _PREFAULT.submit(self)
        except RuntimeError:  # no thread can start (a forked child at its limit)
            self.give_up()

    def run(self) -> None:
        """Fault in up to the target, step by step (on the prefault thread)."""
        while True:
            with self._lock:
                start = self.done
                if start >= self._target:
                    self._running = False
                    return
                end = min(self._target, start + PREFAULT_STEP)
            madvise = _MADVISE  # read at each step: tests swap it
            if madvise is None or madvise(self._base + start, end - start,
                                          _MADV_POPULATE_WRITE) != 0:
                # an older kernel (EINVAL): first touches fault pages in from now on
                logger.debug("lmkv arena: no prefault (%s)", os.strerror(ctypes.get_errno()))
                self.give_up()
                return
            with self._lock:
                self.done = end

    def give_up(self) -> None:
        with self._lock:
            self._failed = True
            self._running = False

    def _forked(self) -> None:
        """In a forked child: the parent's thread and its work are not here."""
        self._lock = threading.Lock()  # (it may have been held by that thread)
        self._running = False

    def wait(self, timeout: float) -> bool:
        """Wait until the thread is idle (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return True
            time.sleep(0.001)
        return False


class _PrefaultThread:
    """The one thread of a process that faults arenas in, started with the first
    prefaulting arena (after a fork, the child's first ``submit`` starts its own)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No thread, no work (a forked child has none of its parent's threads)."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Prefaulter] = queue.SimpleQueue()
        self._started = False

    def ensure(self) -> None:
        """Start the thread unless this process has it."""
        with self._lock:
            if self._started:
                return
            threading.Thread(target=self._serve, args=(self._jobs,), name="lmkv-arena-prefault",
                             daemon=True).start()
            self._started = True

    def submit(self, prefaulter: _Prefaulter) -> None:
        self.ensure()  # a no-op but in a forked child
        self._jobs.put(prefaulter)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Prefaulter]) -> None:
        # Work that can wait: on the engine's CPUs, below its threads' priority (it
        # would inherit the starting thread's, which in vLLM's worker is the
        # forward's main thread, CPU and priority both).
        affinity.apply_background()
        while True:
            prefaulter = jobs.get()
            try:
                prefaulter.run()
            except Exception:  # never the thread's end: the next arena still needs it
                logger.exception("lmkv arena: prefault failed; this arena's pages are "
                                 "faulted in by first touch from now on")
                prefaulter.give_up()
            del prefaulter  # (an arena no allocator uses any more is freed)


_PREFAULT = _PrefaultThread()
_LIVE: weakref.WeakSet[_Prefaulter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """The child has none of the parent's threads: it starts its own prefault
    thread when next needed, and its inherited arenas take work again."""
    _PREFAULT.reset()
    for prefaulter in list(_LIVE):
        prefaulter._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MemoryAllocator:
    """First-fit arena allocator with a hard budget of ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None,
                 alignment: int = ALIGNMENT, buffer: torch.Tensor | None = None,
                 huge_pages: bool = False, prefault_ahead: int = 0) -> None:
        """``buffer``: a flat uint8 tensor of at least ``capacity_bytes`` to place the
        arena in (a shared-memory segment); used as it is, ``pin_memory`` and
        ``huge_pages`` are ignored. ``huge_pages``: advise transparent huge pages
        for an arena that is neither given nor page-locked. ``prefault_ahead``:
        bytes of such an arena to keep faulted in past the highest offset handed
        out, on a background thread (``_Prefaulter``); 0: pages are faulted in by
        whoever touches them first."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes // alignment * alignment
        self._mapping: mmap.mmap | None = None
        if buffer is None and pin_memory:
            self.arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=True)
        elif buffer is None:
            self.arena, self._mapping = _anonymous_arena(self.capacity_bytes, huge_pages)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 \
                or buffer.numel() < self.capacity_bytes:
            raise ValueError(f"buffer must be a flat uint8 tensor of at least "
                             f"{self.capacity_bytes} bytes")
        else:
            self.arena = buffer[:self.capacity_bytes]
        self.prefaulter: _Prefaulter | None = None
        if self._mapping is not None and prefault_ahead > 0 and _MADVISE is not None:
            self.prefaulter = _Prefaulter(self._mapping, self.arena.data_ptr(),
                                          self.capacity_bytes, prefault_ahead)
        self.lock = threading.Lock()  # the view cache and the layouts
        self._views: dict[int, torch.Tensor] = {}
        # Views never take more than a 32nd of the arena's size (tiny chunks
        # cost less than their views), nor VIEW_CACHE_BYTES.
        self._view_cache_most = min(VIEW_CACHE_BYTES, max(
            self.capacity_bytes // 32, _VIEW_CACHE_MIN * VIEW_COST_BYTES)) // VIEW_COST_BYTES
        self._layouts: dict[tuple, Layout] = {}
        self._layout_list: list[Layout] = []
        self._typed: dict[torch.dtype, torch.Tensor | None] = {}  # the arena as each dtype
        # The free list and the counts (first fit over blocks sorted by start,
        # coalescing), in C where the accelerator is built.
        self._core = _ArenaCore(self, self.capacity_bytes, MemoryObj, self._layouts)
        #: ``allocate`` without a Python frame of its own (the core's): for the
        #: callers that allocate per chunk.
        self.fast_allocate: Allocate = self._core.allocate

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer of ``shape``/``dtype``, or None when the arena has no room."""
        return self._core.allocate(shape, dtype)

    @property
    def used_bytes(self) -> int:
        """Bytes of the arena handed out (aligned)."""
        return self._core.used_bytes

    @property
    def live_objects(self) -> int:
        """Buffers handed out and not given back."""
        return self._core.live_objects

    @property
    def _peak_live(self) -> int:
        return self._core.peak_live

    def layout(self, shape: Sequence[int], dtype: torch.dtype) -> Layout:
        """The layout a buffer of ``shape``/``dtype`` gets (ValueError: no such buffer)."""
        dims = shape if type(shape) is tuple else tuple(shape)
        layout = self._layouts.get((dtype, dims))
        return layout if layout is not None else self._layout(dims, dtype)

    def reuse(self, offset: int, layout: Layout) -> MemoryObj:
        """A buffer of ``layout`` over the used block at ``offset``, which its owner
        let go of without freeing it (a tier handing an evicted entry's bytes,
        of the same layout, straight to a new buffer: no free, no allocation)."""
        return self._core.make(offset, layout)

    def _layout(self, dims: tuple, dtype: torch.dtype) -> Layout:
        """The interned layout of ``dims``/``dtype``; past ``MAX_LAYOUTS`` distinct ones
        (shapes from outside without end) a layout of its own, whose views are not
        cached."""
        layouts = self._layouts
        with self.lock:
            layout = layouts.get((dtype, dims))
            if layout is None:
                try:
                    ident = len(layouts) if len(layouts) < MAX_LAYOUTS else -1
                    nbytes = nbytes_of(dims, dtype)
                    layout = Layout(ident, dtype, torch.Size(dims), nbytes,
                                     -(-max(nbytes, 1) // self.alignment) * self.alignment)
                    if layout.nbytes <= self.capacity_bytes:
                        # A view of it, once: a shape torch refuses (a crafted one, say
                        # (2**40, 2**40, 0), whose numel overflows) fails here, not in
                        # the hands of whoever reads the buffer.
                        self.arena[:layout.nbytes].view(dtype).view(layout.shape)
                except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
                    raise ValueError(f"no buffer of shape {dims} and {dtype}: {exc}") from None
                if ident >= 0:
                    layouts[(dtype, dims)] = layout
                    self._layout_list.append(layout)
            return layout

    def interned_layout(self, ident: int) -> Layout:
        """The layout numbered ``ident`` (``Layout.ident`` of an interned one)."""
        return self._layout_list[ident]

    def free_block(self, offset: int, size: int) -> None:
        """Give back the buffer at ``offset`` whose MemoryObj is gone (a tier that
        holds its entries as offsets: ``MemoryObj.ref_down`` of the last reference
        does this for everyone else)."""
        if not self._core.free(offset, size):
            _refcount_bug(f"double free of arena block at offset {offset}")

    def _view(self, offset: int, layout: Layout) -> torch.Tensor:
        """The view of ``layout`` at ``offset``, from the cache (under ``lock``)."""
        if layout.ident < 0:
            return self.arena[offset:offset + layout.nbytes].view(layout.dtype).view(layout.shape)
        key = offset << _LAYOUT_BITS | layout.ident
        views = self._views
        view = views.get(key)
        if view is None:
            view = self._typed_view(offset, layout)
            if len(views) >= self.view_cache_limit:
                del views[next(iter(views))]  # the oldest: dicts keep insertion order
            views[key] = view
        return view

    def _typed_view(self, offset: int, layout: Layout) -> torch.Tensor:
        """A contiguous view of ``layout`` at ``offset``: one ``as_strided`` of the
        arena seen as ``layout.dtype`` (three view calls cost three times that, on
        every miss of the cache)."""
        dtype, itemsize = layout.dtype, layout.dtype.itemsize
        if dtype in self._typed:
            typed = self._typed[dtype]
        else:
            try:
                typed = self.arena[:self.capacity_bytes // itemsize * itemsize].view(dtype)
            except RuntimeError:  # an arena placed where this dtype cannot start
                typed = None
            self._typed[dtype] = typed
        if typed is None or offset % itemsize:
            return self.arena[offset:offset + layout.nbytes].view(dtype).view(layout.shape)
        strides, step = [], 1
        for dim in reversed(layout.shape):
            strides.append(step)
            step *= dim
        # as_strided's offset counts from the storage's start, not the view's
        return typed.as_strided(layout.shape, strides[::-1],
                                typed.storage_offset() + offset // itemsize)

    def view_at(self, offset: int, layout: Layout) -> torch.Tensor:
        """The tensor of the buffer of ``layout`` at ``offset`` (``MemoryObj.tensor``)."""
        if layout.ident >= 0:
            view = self._views.get(offset << _LAYOUT_BITS | layout.ident)
            if view is not None:
                return view
        with self.lock:
            return self._view(offset, layout)

    @property
    def view_cache_limit(self) -> int:
        """Views the cache may hold now (see the module docstring)."""
        return min(self._view_cache_most, max(_VIEW_CACHE_MIN, 2 * self._peak_live))

    @property
    def view_cache_bytes(self) -> int:
        """Estimated memory held by cached views."""
        return len(self._views) * VIEW_COST_BYTES

    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, size) of every free block."""
        return self._core.blocks()

    @property
    def largest_free_block(self) -> int:
        return self._core.largest
