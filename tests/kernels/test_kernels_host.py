"""lmkv_kernels' C copies for host caches (``host_impl``, ``host.c``): bit for bit
the reference's moves, split over threads or not, on the CPUs named; every
address checked before a byte moves; what they do not serve goes to the
reference. (The token-by-token round trip over every layout and dtype:
``test_kernels.py``.)"""

from __future__ import annotations

import os
import random

import pytest
import torch

from lmkv_kernels import gather_blocks, host_impl, scatter_blocks, torch_ref, use_host_cpus

pytestmark = pytest.mark.skipif(not host_impl.available(),
                                reason="lmkv_kernels' C copies were not built")

HEADS, DIM = 4, 64


def caches(layers: int, blocks: int, block: int, dtype: torch.dtype,
           gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(blocks, HEADS, block, 2 * DIM, generator=gen).to(dtype)
            for _ in range(layers)]


def outer(layers: int, tokens: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A heads-outer chunk buffer (``KVSpec.heads_outer``), viewed ``[layers, 2, tokens,
    heads, dim]``, filled."""
    held = torch.randn(layers, HEADS, tokens, 2, DIM, generator=gen).to(dtype)
    return held.permute(0, 3, 2, 1, 4)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(autouse=True)
def _own_cpus():  # type: ignore[no-untyped-def]
    yield
    use_host_cpus(None)
    host_impl.use_team(True)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_large_copies_split_over_threads_match_the_reference(seed: int,
                                                             dtype: torch.dtype) -> None:
    """Prompts of MiBs, scattered block tables, chunks that straddle blocks, a
    skipped prefix: the reference's bits, nothing else touched."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layers, block = rng.choice([(2, 16), (4, 128), (3, 48)])
    tokens = rng.randint(block, 1200)
    n = -(-tokens // block)
    num_blocks = n + rng.randint(0, 6)
    ids = rng.sample(range(num_blocks), n)
    chunks, start = [], rng.choice([0, 0, 5])
    while start < tokens:
        size = min(rng.choice([100, 256, 333]), tokens - start)
        chunks.append((start, outer(layers, size, dtype, gen)))
        start += size
    skip = rng.choice([0, 0, 1, tokens // 2])
    if seed % 2:
        use_host_cpus(os.sched_getaffinity(0))
    mine = caches(layers, num_blocks, block, dtype, gen)
    ref = [c.clone() for c in mine]
    scatter_blocks(mine, ids, chunks, skip, layout="cpu", kernels="host")
    scatter_blocks(ref, ids, chunks, skip, layout="cpu", kernels="torch")
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(mine, ref, strict=True))
    got = [(s, torch.zeros_like(b)) for s, b in chunks]
    want = [(s, torch.zeros_like(b)) for s, b in chunks]
    gather_blocks(mine, ids, got, layout="cpu", kernels="host")
    gather_blocks(mine, ids, want, layout="cpu", kernels="torch")
    assert all(torch.equal(bits(a), bits(b)) for (_, a), (_, b) in zip(got, want, strict=True))


def test_a_bad_block_id_or_short_table_copies_nothing() -> None:
    """Every run is checked before the first byte moves: one line, caches as they were."""
    gen = torch.Generator().manual_seed(1)
    mine = caches(2, 8, 16, torch.float32, gen)
    before = [c.clone() for c in mine]
    chunk = outer(2, 64, torch.float32, gen)
    for ids, match in (([0, 1, 2, 8], r"block id 8 out of range 0\.\.7"),
                       ([0, 1, -1, 3], r"block id -1 out of range"),
                       ([0, 1, 2], "the block table does not cover the tokens copied")):
        with pytest.raises(ValueError, match=f"^copy_blocks: {match}"):
            scatter_blocks(mine, ids, [(0, chunk)], layout="cpu", kernels="host")
        assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))


def test_runs_past_a_tensor_s_storage_are_refused() -> None:
    """Extents come from the tensors' storage, not their shapes: a cache or buffer
    smaller than the copy says is refused."""
    gen = torch.Generator().manual_seed(2)
    mine = caches(2, 8, 16, torch.float32, gen)
    chunk = outer(2, 32, torch.float32, gen)
    from lmkv_kernels._native import _host

    args = (True, [c.data_ptr() for c in mine], mine[0].numel() * 4,
            tuple(s * 4 for s in mine[0].stride()[:3]), 8, HEADS, 2 * DIM * 4, 16, [0, 1])
    strides = tuple(s * 4 for s in chunk.permute(0, 3, 2, 1, 4).flatten(3).stride()[:3])
    short = chunk.numel() * 4 - 1
    with pytest.raises(ValueError, match=r"^copy_blocks: a run past the end of a tensor$"):
        _host.copy_blocks(*args, [(chunk.data_ptr(), short, strides, 0, 0, 32)], 1, None)
    with pytest.raises(ValueError, match=r"^copy_blocks: a run past the end of a tensor$"):
        _host.copy_blocks(True, args[1], 16 * 4 * 2 * DIM * 4 - 1, *args[3:],
                          [(chunk.data_ptr(), chunk.numel() * 4, strides, 0, 0, 32)], 1, None)
    for start, first, stop in ((4, 0, 32), (-8, -8, 8), (0, 8, 4)):
        with pytest.raises(ValueError, match=r"^copy_blocks: tokens before the buffer's "
                                             r"first, or a negative range$"):
            _host.copy_blocks(*args, [(chunk.data_ptr(), chunk.numel() * 4, strides, start,
                                       first, stop)], 1, None)
    huge = 1 << 62  # strides whose products overflow: refused, not wrapped past the check
    for cache_strides, chunk_strides in (((huge, 4, 4), strides), (args[3], (huge, huge, 4))):
        with pytest.raises(ValueError, match=r"^copy_blocks: a run past the end of a tensor$"):
            _host.copy_blocks(True, args[1], args[2], cache_strides, *args[4:],
                              [(chunk.data_ptr(), chunk.numel() * 4, chunk_strides, 0, 0, 32)],
                              1, None)


def test_a_negative_start_never_reaches_memory_before_the_caches() -> None:
    """A chunk said to start before token 0 is refused (the reference would wrap
    the block table's index; the C side would address before the cache)."""
    gen = torch.Generator().manual_seed(8)
    mine = caches(1, 4, 16, torch.float32, gen)
    before = [c.clone() for c in mine]
    with pytest.raises(ValueError, match="negative range"):
        gather_blocks(mine, [0], [(-8, outer(1, 16, torch.float32, gen))], layout="cpu",
                      kernels="host")
    with pytest.raises(ValueError, match="negative range"):
        scatter_blocks(mine, [0], [(-8, outer(1, 16, torch.float32, gen))], skip_tokens=-8,
                       layout="cpu", kernels="host")
    assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))


def test_a_buffer_of_other_layers_or_heads_goes_to_the_reference() -> None:
    """A view of fewer layers (or heads) than the caches, over a larger slab, is
    never copied past the view: the reference gets it (and refuses it)."""
    gen = torch.Generator().manual_seed(9)
    mine = caches(2, 4, 16, torch.float32, gen)
    slab = torch.randn(2, HEADS, 16, 2, DIM, generator=gen)
    one_layer = slab[:1].permute(0, 3, 2, 1, 4)
    before = [c.clone() for c in mine]
    with pytest.raises(RuntimeError):
        scatter_blocks(mine, [0], [(0, one_layer)], layout="cpu", kernels="host")
    assert torch.equal(mine[1], before[1])  # the slab's second layer never landed


def test_what_the_c_copies_do_not_serve_goes_to_the_reference(monkeypatch) -> None:
    """Canonical buffers beside heads-outer ones, and layouts other than cpu, are
    copied by the reference; the heads-outer ones by C."""
    gen = torch.Generator().manual_seed(3)
    mine = caches(2, 8, 16, torch.float32, gen)
    ids = [3, 1, 6, 0, 2, 7]
    heads_outer = outer(2, 48, torch.float32, gen)
    canonical = torch.randn(2, 2, 48, HEADS, DIM, generator=gen)
    handed = []
    real = torch_ref.scatter_blocks
    monkeypatch.setattr(torch_ref, "scatter_blocks",
                        lambda c, i, chunks, *a: handed.extend(s for s, _ in chunks)
                        or real(c, i, chunks, *a))
    ref = [c.clone() for c in mine]
    scatter_blocks(mine, ids, [(0, heads_outer), (48, canonical)], layout="cpu", kernels="host")
    assert handed == [48]
    monkeypatch.setattr(torch_ref, "scatter_blocks", real)
    scatter_blocks(ref, ids, [(0, heads_outer), (48, canonical)], layout="cpu",
                   kernels="torch")
    assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True))
    flash = [torch.zeros(2, 8, 16, HEADS, DIM) for _ in range(2)]
    handed.clear()
    monkeypatch.setattr(torch_ref, "scatter_blocks",
                        lambda c, i, chunks, *a: handed.extend(s for s, _ in chunks)
                        or real(c, i, chunks, *a))
    scatter_blocks(flash, ids, [(0, canonical)], layout="flash", kernels="host")
    assert handed == [0]


def test_helper_threads_run_on_the_cpus_named() -> None:
    """A 32 MiB load, split over threads (from 1 MiB on): one thread, the CPUs
    this process has, and CPUs it does not have (ignored: a thread keeps its own
    affinity); the copy is the same every way."""
    gen = torch.Generator().manual_seed(4)
    mine = caches(4, 40, 128, torch.float32, gen)
    ref = [c.clone() for c in mine]
    chunks = [(s, outer(4, 256, torch.float32, gen)) for s in range(0, 4096, 256)]
    ids = list(range(40))[::-1][:32]
    for team in (False, True):  # the main thread's copies: lmkv's helpers, its OpenMP team
        host_impl.use_team(team)
        for cpus in ([0], sorted(os.sched_getaffinity(0)), [10_000]):
            use_host_cpus(cpus)
            scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")
    scatter_blocks(ref, ids, chunks, layout="cpu", kernels="torch")
    assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True))


def _big_load(seed: int) -> tuple[list[torch.Tensor], list[int], list]:
    """32 MiB of float32 KV (over the split threshold): caches, a table, chunks."""
    gen = torch.Generator().manual_seed(seed)
    mine = caches(4, 40, 128, torch.float32, gen)
    chunks = [(s, outer(4, 256, torch.float32, gen)) for s in range(0, 4096, 256)]
    return mine, random.Random(seed).sample(range(40), 32), chunks


def test_copies_from_two_threads_at_once_are_both_whole() -> None:
    """One copy has the helper threads, the other copies on its own thread."""
    import threading

    loads = [_big_load(seed) for seed in (5, 6)]
    refs = []
    for mine, ids, chunks in loads:
        ref = [c.clone() for c in mine]
        scatter_blocks(ref, ids, chunks, layout="cpu", kernels="torch")
        refs.append(ref)
    barrier = threading.Barrier(2)

    def copy(load) -> None:  # type: ignore[no-untyped-def]
        mine, ids, chunks = load
        barrier.wait(10)
        for _ in range(5):
            scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")

    threads = [threading.Thread(target=copy, args=(load,)) for load in loads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for (mine, _, _), ref in zip(loads, refs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.parametrize("parent", ["helpers", "team"])
def test_a_forked_child_copies_with_helpers_of_its_own(parent: str) -> None:
    """The parent's helper threads are not in a forked child: it starts its own
    (and no lock a parent's thread held at the fork is held in it). Nor is the
    parent's OpenMP team: a child whose parent copied on it copies on helpers
    too, with as many threads as torch's (its first parallel region on the
    team would wait for ever for threads that are not there)."""
    import time

    mine, ids, chunks = _big_load(7)
    host_impl.use_team(parent == "team")
    if parent == "helpers":
        use_host_cpus(range(4))  # four threads: helpers, wherever the CPUs are
    scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")
    assert host_impl._host.last_ran() == parent
    again = [torch.zeros_like(c) for c in mine]
    pid = os.fork()
    if pid == 0:  # the child: copy again, exit 0 when it matches
        code = 1
        try:
            if parent == "helpers":
                # (torch's OpenMP threads are not fork-safe: none in the child)
                torch.set_num_threads(1)
            scatter_blocks(again, ids, chunks, layout="cpu", kernels="host")
            ran = host_impl._host.last_ran()
            torch.set_num_threads(1)  # (before torch's own loops: the comparison)
            code = 0 if ran == "helpers" and all(torch.equal(a[ids], b[ids])
                                                 for a, b in zip(again, mine, strict=True)) \
                else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's copy did not finish in 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


_THREADS_PROBE = """
import os, sys, torch
from lmkv_kernels import host_impl, scatter_blocks
sys.path.insert(0, {here!r})
from test_kernels_host import _big_load
torch.set_num_threads(2)
team = host_impl.use_team({team})
torch.ones(1 << 22).add_(1)  # a parallel loop: the main thread's OpenMP team is up
before = len(os.listdir("/proc/self/task"))
mine, ids, chunks = _big_load(8)
scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")
print(team, host_impl._host.last_ran(), len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not host_impl._torch_on_openmp(), reason="torch does not run on OpenMP")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: copies are not split")
@pytest.mark.parametrize("team", [True, False])
def test_the_main_thread_s_copies_run_on_its_openmp_team(team: bool) -> None:
    """A copy split over threads on the main thread runs on the thread's OpenMP
    team (torch's threads): the process gains no thread. With the team off,
    lmkv's helper starts beside it."""
    import subprocess
    import sys

    probe = _THREADS_PROBE.format(here=os.path.dirname(__file__), team=team)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ([str(team), "team", "0"] if team else [str(team), "helpers", "1"])


@pytest.mark.skipif(not host_impl._torch_on_openmp(), reason="torch does not run on OpenMP")
def test_a_team_of_one_thread_copies_alone_and_other_threads_use_helpers() -> None:
    """The team is the main thread's only: a copy on another thread shares the
    work with lmkv's helpers. A main thread whose team has one thread (torch's
    thread count set to 1, as in a fork-safe child) copies as it asked: here
    on two threads, the caller and a helper."""
    import threading

    mine, ids, chunks = _big_load(10)
    assert host_impl.use_team(True)
    ran: list[str | None] = []

    def off_main() -> None:
        scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")
        ran.append(host_impl._host.last_ran())

    worker = threading.Thread(target=off_main)
    worker.start()
    worker.join(60)
    assert ran == ["helpers"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        use_host_cpus(range(2))  # (two threads asked for: the team has one)
        scatter_blocks(mine, ids, chunks, layout="cpu", kernels="host")
        assert host_impl._host.last_ran() == "helpers"
    finally:
        torch.set_num_threads(threads)


def test_a_copy_on_the_team_matches_one_on_helpers_and_the_reference() -> None:
    """The same load three ways: the main thread's team, lmkv's helpers, torch."""
    mine, ids, chunks = _big_load(9)
    results = []
    for team in (True, False):
        host_impl.use_team(team)
        target = [torch.zeros_like(c) for c in mine]
        scatter_blocks(target, ids, chunks, layout="cpu", kernels="host")
        results.append(target)
    ref = [torch.zeros_like(c) for c in mine]
    scatter_blocks(ref, ids, chunks, layout="cpu", kernels="torch")
    for got in results:
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@pytest.mark.parametrize("kernels", ["host", "torch"])
def test_buffers_given_as_held_copy_as_their_views_do(kernels: str) -> None:
    """``heads_outer=True``: buffers as held in memory (``[layers, heads, tokens, 2,
    dim]``) move the bits their ``[layers, 2, tokens, heads, dim]`` views move."""
    gen = torch.Generator().manual_seed(11)
    held = [(0, torch.randn(2, HEADS, 48, 2, DIM, generator=gen)),
            (48, torch.randn(2, HEADS, 30, 2, DIM, generator=gen))]
    views = torch_ref.planes_first(held)
    ids = [5, 2, 7, 0, 3]
    base = caches(2, 8, 16, torch.float32, gen)
    mine, ref = [c.clone() for c in base], [c.clone() for c in base]
    scatter_blocks(mine, ids, held, 3, layout="cpu", kernels=kernels, heads_outer=True)
    scatter_blocks(ref, ids, views, 3, layout="cpu", kernels="torch")
    assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True))
    got = [(s, torch.zeros_like(b)) for s, b in held]
    gather_blocks(base, ids, got, layout="cpu", kernels=kernels, heads_outer=True)
    want = [(s, torch.zeros_like(b)) for s, b in views]
    gather_blocks(base, ids, want, layout="cpu", kernels="torch")
    assert all(torch.equal(a.permute(0, 3, 2, 1, 4), b)
               for (_, a), (_, b) in zip(got, want, strict=True))


def test_a_bound_set_is_used_only_for_the_caches_it_checked() -> None:
    """``bind`` checks a set of caches once; given with caches at other addresses
    (another set, or one whose tensors were replaced), the copy checks those
    instead and lands in them, never in the set it was bound to."""
    from lmkv_kernels import bind

    gen = torch.Generator().manual_seed(12)
    first = caches(2, 8, 16, torch.float32, gen)
    bound = bind(first, "cpu")
    assert bound.implementation is host_impl and bound.host is not None
    chunk = outer(2, 32, torch.float32, gen)
    other = caches(2, 8, 16, torch.float32, gen)
    before = [c.clone() for c in first]
    ref = [c.clone() for c in other]
    scatter_blocks(other, [4, 1], [(0, chunk)], layout="cpu", bound=bound)
    scatter_blocks(ref, [4, 1], [(0, chunk)], layout="cpu", kernels="torch")
    assert all(torch.equal(a, b) for a, b in zip(other, ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, before, strict=True))
    smaller = [torch.randn(4, HEADS, 16, 2 * DIM, generator=gen) for _ in range(2)]
    with pytest.raises(ValueError, match=r"block id 6 out of range 0\.\.3"):
        scatter_blocks(smaller, [6, 1], [(0, chunk)], layout="cpu", bound=bound)
    # At the bound's very addresses, with fewer blocks (as new tensors allocated
    # where a freed set was): the geometry is the new one's, not the bound's.
    for cache in first:
        cache.resize_(4, HEADS, 16, 2 * DIM)
    assert [c.data_ptr() for c in first] == bound.host.ptrs
    with pytest.raises(ValueError, match=r"block id 6 out of range 0\.\.3"):
        scatter_blocks(first, [6, 1], [(0, chunk)], layout="cpu", bound=bound)


def test_a_set_of_caches_changed_in_place_is_checked_again() -> None:
    """Copies without a bound remember the sets they checked by each cache's
    address, shape and strides: a cache replaced in its list, or resized in
    place to fewer blocks, is checked again before a byte moves."""
    gen = torch.Generator().manual_seed(13)
    mine = caches(2, 8, 16, torch.float32, gen)
    chunk = outer(2, 32, torch.float32, gen)
    scatter_blocks(mine, [6, 1], [(0, chunk)], layout="cpu", kernels="host")
    replaced = mine[1]
    mine[1] = torch.zeros_like(replaced)
    kept = replaced.clone()
    scatter_blocks(mine, [5, 2], [(0, chunk)], layout="cpu", kernels="host")
    assert torch.equal(replaced, kept)  # the tensor no longer in the set is untouched
    assert torch.equal(mine[1][5], chunk.permute(0, 3, 2, 1, 4)[1, :, :16].flatten(2))
    mine[0].resize_(4, HEADS, 16, 2 * DIM)  # (the same storage: its address unchanged)
    mine[1].resize_(4, HEADS, 16, 2 * DIM)
    with pytest.raises(ValueError, match=r"block id 6 out of range 0\.\.3"):
        scatter_blocks(mine, [6, 1], [(0, chunk)], layout="cpu", kernels="host")
