"""The paged copies for caches in host memory: ``memcpy`` runs split over
threads, in C (``lmkv_kernels._native._host``, built from ``_native/host.c``
where a C compiler is at hand at install time).

It serves cpu-layout caches and chunk buffers held heads outer
(``KVSpec.heads_outer``: a head's tokens of a block are one run on both sides),
vLLM's CPU build: a load or store of a prompt is then one call, and its runs
are shared between threads, where torch's copies run one block at a time on
one thread. On the main thread (where an engine runs its forward) the
threads are the thread's OpenMP team, the one torch's own parallel loops
use (``GOMP_parallel``, resolved in the process as torch's calls are): they
are on the engine's cores and still awake from the forward, and threads of
lmkv's beside them would wait for those cores while they spin (measured on
2 CPUs right after a torch op: the copies took 1.4-1.8x as long). On other
threads (lmkv's loaders and savers), where the team has one thread, in a
child forked after this module was imported, and where torch does not run
on OpenMP, the calling thread and lmkv's helper threads share them
(``use_cpus``). A process forked from one that ran torch's parallel loops
must set ``torch.set_num_threads(1)`` before its own (torch's as much as
these): an OpenMP team does not survive a fork. Anything else (other
layouts, buffers in another order or on another device) goes to
``torch_ref``, the reference the copies here match bit for bit (a memcpy
moves bits as they are).

Every run is checked against the block table's range and both tensors'
storage before a byte moves (``ValueError``, nothing copied): the C side
trusts no address it did not check.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from lmkv_kernels import torch_ref
from lmkv_kernels.layouts import Layout, PagedGeometry, geometry, signature
from lmkv_kernels.torch_ref import BlockIds, Chunks

try:
    from lmkv_kernels._native import _host
except ImportError:  # built without a C compiler: torch's copies
    _host = None  # type: ignore[assignment]  # (None: the module was not built)

_cpus: tuple[int, ...] | None = None
_MAIN = threading.main_thread().ident or 0
#: Given for ``bound`` where the caller has not bound the caches.
UNBOUND: Any = object()


def _torch_on_openmp() -> bool:
    """Whether torch runs its parallel loops on an OpenMP runtime."""
    try:
        return "parallel backend: OpenMP" in torch.__config__.parallel_info()
    except Exception:  # (a torch without it: lmkv's threads)
        return False


def use_team(on: bool = True) -> bool:
    """Whether the main thread's copies that are split over threads run on its
    OpenMP team (the default, where torch runs on OpenMP and the team has more
    than one thread) or on lmkv's helper threads; returns whether the team is
    now used."""
    return _host is not None and bool(_host.use_openmp(on and _torch_on_openmp(), _MAIN))


use_team()


def available() -> bool:
    """Whether the C copies were built."""
    return _host is not None


def use_cpus(cpus: Iterable[int] | None) -> None:
    """The CPUs the copies run on, one thread each (the caller's among them);
    None: as many threads as torch's (``torch.get_num_threads()``), on the
    caller's CPUs. An engine that binds its threads one to a CPU gives its set
    here: a helper thread would otherwise inherit the caller's single CPU. (A
    helper keeps the CPUs it was last given: None does not widen it again.)
    A copy on the OpenMP team (``use_team``) runs on the team's threads, as
    many as it has and where the engine bound them; a set of one CPU still
    keeps every copy on its calling thread."""
    global _cpus
    _cpus = tuple(sorted(set(cpus))) if cpus is not None else None


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                  layout: Layout | None = None, heads_outer: bool = False,
                  bound: Any = UNBOUND) -> None:
    """``heads_outer``: buffers as held in memory (``lmkv_kernels.gather_blocks``);
    ``bound``: ``bind(caches, layout)``, made before (else checked here)."""
    rest = _copy(caches, block_ids, chunks, 0, layout, into_caches=False,
                 heads_outer=heads_outer, bound=bound)
    if rest:
        torch_ref.gather_blocks(caches, block_ids, torch_ref.planes_first(rest, heads_outer),
                                layout)


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                   skip_tokens: int = 0, layout: Layout | None = None,
                   heads_outer: bool = False, bound: Any = UNBOUND) -> None:
    rest = _copy(caches, block_ids, chunks, skip_tokens, layout, into_caches=True,
                 heads_outer=heads_outer, bound=bound)
    if rest:
        torch_ref.scatter_blocks(caches, block_ids, torch_ref.planes_first(rest, heads_outer),
                                 skip_tokens, layout)


def scatter_bound(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
                  skip_tokens: int, heads_outer: bool, bound: Bound) -> None:
    """``scatter_blocks`` with ``bound`` taken as it is, not compared with the
    caches again: the caller knows it is these caches' (the ``paged`` connector
    checks its caches per call: by ``signature``, or as the very tensors of the
    set it bound last, each at its address, with the storage each had then
    held), and the memory it names theirs."""
    rest = _copy(caches, block_ids, chunks, skip_tokens, None, into_caches=True,
                 heads_outer=heads_outer, bound=bound, checked=True)
    if rest:
        torch_ref.scatter_blocks(caches, block_ids, torch_ref.planes_first(rest, heads_outer),
                                 skip_tokens, bound.signature[0])


#: The longest row (one head's K and V of a token) a checked copy takes (host.c's BOUNCE).
CHECKED_ROW_BYTES = 16 << 10


def can_check() -> bool:
    """Whether ``scatter_checked`` was built (the C copies, with libxxhash)."""
    return _host is not None and hasattr(_host, "copy_checked")


def scatter_checked(caches: Sequence[torch.Tensor], block_ids: BlockIds,
                    chunks: Sequence[tuple[int, int, torch.Tensor, int]], skip_tokens: int = 0,
                    layout: Layout | None = None, bound: Any = UNBOUND) -> list[bool] | None:
    """``scatter_blocks`` of whole chunk buffers held heads outer, each checked as
    it is copied: ``(start, stop, buffer, checksum)`` copies the buffer's tokens
    up to the request's ``stop`` and reads all of its bytes, in memory order,
    into their xxh3-64 (seed 0), which must be ``checksum``. Each buffer is read
    once, a few KiB at a time into a thread's own small buffer, and the bytes
    copied are the bytes checked. One thread a chunk.

    The buffers are taken as heads outer (``[layers, kv_heads, tokens, 2,
    head_dim]``): the caller knows their order; shapes alone cannot tell it
    where there are two KV heads.

    Returns, per chunk, whether its bytes matched (one that did not may have
    been copied in part); None, having copied nothing, where these copies do not
    serve the caches or a buffer (not built, another layout, a buffer whose
    elements are not back to back in order, a span past its tokens): copy and
    check another way then."""
    if not can_check() or not chunks:
        return None
    bound = _bound_for(caches, layout, bound)
    if bound is None or bound.row > CHECKED_ROW_BYTES:
        return None
    runs = []
    for start, stop, buf, checksum in chunks:
        tokens = buf.shape[2] if buf.dim() == 5 else 0
        if not (start < stop <= start + tokens and 0 <= checksum < 1 << 64) \
                or buf.stride() != _packed(buf.shape):
            return None
        run = _run(buf, bound, heads_outer=True)
        if run is None:
            return None
        address, _, strides = run
        # (read whole: its bytes, not the storage's past them)
        runs.append((address, buf.numel() * bound.size, strides, start,
                     min(max(start, skip_tokens), stop), stop, tokens, checksum))
    return _host.copy_checked(bound.ptrs, bound.extent, bound.strides, bound.num_blocks,
                              bound.heads, bound.row, bound.block_size, _ids(block_ids), runs,
                              *_threads())


def _bound_for(caches: Sequence[torch.Tensor], layout: Layout | None, bound: Any) -> Any:
    """``bound`` where it is for these caches in ``layout`` (the ones it checked,
    or ones the C side sees as the same), else theirs (None: not served)."""
    if bound is UNBOUND or (bound is not None
                            and bound.signature != (layout, *signature(caches))):
        return _bind(caches, layout)
    return bound


def _ids(block_ids: BlockIds) -> Sequence[int]:
    return block_ids.tolist() if isinstance(block_ids, torch.Tensor) else block_ids


def _threads() -> tuple[int, tuple[int, ...] | None]:
    """How many threads a copy may use, and the CPUs named for them (``use_cpus``)."""
    cpus = _cpus
    return (len(cpus) if cpus else max(1, torch.get_num_threads())), cpus


def _copy(caches: Sequence[torch.Tensor], block_ids: BlockIds, chunks: Chunks,
          skip_tokens: int, layout: Layout | None, *, into_caches: bool,
          heads_outer: bool = False, bound: Any = UNBOUND, checked: bool = False) -> list:
    """Copy what the C side serves; the chunks it does not, returned. ``checked``:
    ``bound`` is these caches' (``scatter_bound``)."""
    if not chunks:
        return []
    if _host is None:
        return list(chunks)
    if not checked:
        bound = _bound_for(caches, layout, bound)
    if bound is None:
        return list(chunks)
    runs: list[tuple[int, int, tuple[int, int, int], int, int, int]] = []
    rest = []
    for start, buf in chunks:
        stop = start + buf.shape[2]
        first = max(start, skip_tokens) if into_caches else start
        if stop <= first:
            continue
        run = _run(buf, bound, heads_outer)
        if run is None:
            rest.append((start, buf))  # (the reference copies it, or says what is wrong)
            continue
        runs.append((*run, start, first, stop))
    if runs:
        _host.copy_blocks(into_caches, bound.ptrs, bound.extent, bound.strides,
                          bound.num_blocks, bound.heads, bound.row, bound.block_size,
                          _ids(block_ids), runs, *_threads())
    return rest


class Bound(NamedTuple):
    """What the C copies need of a set of caches, checked once (``bind``)."""

    ptrs: list[int]
    extent: int  # bytes from each cache's first element to the end of the shortest storage
    strides: tuple[int, int, int]  # in bytes
    num_blocks: int
    heads: int
    row: int  # bytes of a (block, head, token) row: 2 * head_dim elements
    block_size: int
    head_dim: int
    layers: int
    dtype: torch.dtype
    size: int
    signature: tuple  # (layout, *signature(caches)) of the caches checked


#: The caches copies ran on without a bound given, by ``signature`` (None: a
#: set the C side does not serve).
_bound: dict[tuple, Bound | None] = {}
_BOUND_KEPT = 256


def bind(caches: Sequence[torch.Tensor], layout: Layout | None,
         key: tuple | None = None) -> Bound | None:
    """What the C copies need of ``caches`` (checked now), or None where they do
    not serve them (another layout or device, layers that differ, rows that are
    not whole). ``key``: ``(layout, *signature(caches))``, where already made."""
    g = geometry(caches[0], layout)
    if not _served(caches, g):
        return None
    first = caches[0]
    size = first.element_size()
    return Bound([cache.data_ptr() for cache in caches],
                 min(_extent(cache) for cache in caches), _strides(first, size),
                 g.num_blocks, g.kv_heads, 2 * g.head_dim * size, g.block_size, g.head_dim,
                 len(caches), first.dtype, size,
                 key if key is not None else (layout, *signature(caches)))


def _bind(caches: Sequence[torch.Tensor], layout: Layout | None) -> Bound | None:
    key = (layout, *signature(caches))
    try:
        return _bound[key]
    except KeyError:
        pass
    bound = bind(caches, layout, key)
    if len(_bound) >= _BOUND_KEPT:
        _bound.clear()
    _bound[key] = bound
    return bound


def _run(buf: torch.Tensor, bound: Bound, heads_outer: bool
         ) -> tuple[int, int, tuple[int, int, int]] | None:
    """A chunk buffer held heads outer in memory (``[layers, kv_heads, tokens, 2,
    head_dim]``; with ``heads_outer`` given so, else as its ``[layers, 2, tokens,
    kv_heads, head_dim]`` view, ``torch_ref._head_runs``): its address, extent and
    the byte strides of its layers, heads and tokens; None for any other buffer
    (order, device, dtype or sizes)."""
    shape = buf.shape
    if len(shape) != 5 or not buf.is_cpu or buf.dtype != bound.dtype:
        return None
    # (the dimensions of heads and planes: where each is in the order given)
    h, p = (1, 3) if heads_outer else (3, 1)
    if shape[0] != bound.layers or shape[h] != bound.heads or shape[p] != 2 \
            or shape[4] != bound.head_dim:
        return None
    stride = buf.stride()
    layer, head, token, plane, elem = stride[0], stride[h], stride[2], stride[p], stride[4]
    d = bound.head_dim
    if elem != 1 or plane != d or token != 2 * d:
        return None
    size = bound.size  # (the dtype's: buf's is the caches')
    extent = int(buf.untyped_storage().nbytes() - buf.storage_offset() * size)
    return (buf.data_ptr(), extent, (layer * size, head * size, token * size))


def _packed(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` whose elements are back to back in
    order (``is_contiguous`` also takes any stride of a dimension of one)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _served(caches: Sequence[torch.Tensor], g: PagedGeometry) -> bool:
    """cpu-layout caches in host memory, one shape, dtype and strides, rows whole."""
    if g.layout != "cpu" or g.planes != 2:
        return False
    first = caches[0]
    if first.device.type != "cpu" or first.stride(3) != 1:
        return False
    return all(c.device == first.device and c.shape == first.shape and c.dtype == first.dtype
               and c.stride() == first.stride() for c in caches)


def _strides(t: torch.Tensor, size: int) -> tuple[int, int, int]:
    """The first three strides of ``t``, in bytes."""
    a, b, c = t.stride()[:3]
    return a * size, b * size, c * size


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its storage."""
    return int(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())
