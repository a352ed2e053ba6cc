"""Checked copies (``lmkv_kernels.scatter_checked``, ``host.c``'s ``copy_checked``):
whole heads-outer chunk buffers copied into cpu caches, each one's bytes read once
and compared with an xxh3-64 on the way. The bits ``scatter_blocks`` would move,
nothing past a chunk's tokens or before ``skip_tokens`` touched, a verdict per
chunk that is the checksum's, on one thread or several; buffers they do not take
are left to the caller (None, nothing copied)."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
import xxhash

import lmkv_kernels
from lmkv_kernels import host_impl, scatter_blocks, scatter_checked, use_host_cpus

#: CI sets it (it installs libxxhash-dev): a build without checked copies fails there.
REQUIRED = os.environ.get("CI_REQUIRE_CHECKED_LOADS") == "1"
pytestmark = pytest.mark.skipif(not (host_impl.can_check() or REQUIRED),
                                reason="lmkv_kernels' C copies were built without libxxhash")


def test_the_checked_copies_were_built() -> None:
    assert host_impl.can_check(), \
        "lmkv_kernels._native._host has no copy_checked: was libxxhash-dev installed at setup?"

HEADS, DIM = 4, 64


def caches(layers: int, blocks: int, block: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(blocks, HEADS, block, 2 * DIM, dtype=dtype) for _ in range(layers)]


def chunk(layers: int, tokens: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A whole heads-outer chunk buffer ``[layers, heads, tokens, 2, dim]``."""
    return torch.randn(layers, HEADS, tokens, 2, DIM, generator=gen).to(dtype)


def checksum(buf: torch.Tensor) -> int:
    return xxhash.xxh3_64(buf.contiguous().view(torch.uint8).numpy()).intdigest()


def bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for t in ts]


@pytest.fixture(autouse=True)
def _own_cpus():  # type: ignore[no-untyped-def]
    yield
    use_host_cpus(None)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checked_copies_move_the_references_bits_and_judge_each_chunk(
        seed: int, dtype: torch.dtype) -> None:
    """Chunks that straddle blocks, a short last span, a skipped prefix, one
    chunk with a wrong checksum: the bits ``scatter_blocks`` moves for the
    spans, the other chunks judged matched."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layers, block, size = rng.choice([(2, 16, 40), (4, 128, 256), (3, 48, 100)])
    n = rng.randint(1, 6)
    tokens = n * size - rng.randint(0, size - 1)  # the last span may end inside its chunk
    blocks = -(-tokens // block)
    ids = rng.sample(range(blocks + 4), blocks)
    skip = rng.choice([0, 0, 7, size + 3])
    bufs = [chunk(layers, size, dtype, gen) for _ in range(n)]
    sums = [checksum(b) for b in bufs]
    bad = rng.randrange(n) if seed % 2 else None
    if bad is not None:
        sums[bad] ^= 1 << rng.randrange(64)
    spans = [(i * size, min((i + 1) * size, tokens), b, s)
             for i, (b, s) in enumerate(zip(bufs, sums, strict=True))]
    got = caches(layers, blocks + 4, block, dtype)
    verdicts = scatter_checked(got, ids, spans, skip)
    assert verdicts == [i != bad for i in range(n)]
    want = caches(layers, blocks + 4, block, dtype)
    scatter_blocks(want, ids, [(a, b[:, :, :e - a]) for a, e, b, _ in spans], skip,
                   heads_outer=True)
    assert all(torch.equal(g, w) for g, w in zip(bits(got), bits(want), strict=True))


def test_a_checksum_is_of_every_byte_of_the_chunk_even_past_its_span() -> None:
    """A byte changed after the span's last token (not copied) still fails it."""
    gen = torch.Generator().manual_seed(1)
    buf = chunk(2, 64, torch.float32, gen)
    total = checksum(buf)
    buf[1, HEADS - 1, 63, 1, DIM - 1] += 1  # the last byte the payload has
    verdicts = scatter_checked(caches(2, 8, 16, torch.float32), list(range(4)),
                               [(0, 40, buf, total)])
    assert verdicts == [False]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_one_thread_or_many_judge_and_copy_the_same(threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    bufs = [chunk(8, 256, torch.float32, gen) for _ in range(6)]
    sums = [checksum(b) for b in bufs]
    sums[3] += 1
    ids = list(range(12))[::-1]
    use_host_cpus(list(range(threads)))  # (named CPUs past the machine's are dropped)
    got = caches(8, 12, 128, torch.float32)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(
        scatter_checked(got, ids, [(i * 256, i * 256 + 256, b, s)
                                   for i, (b, s) in enumerate(zip(bufs, sums, strict=True))])))
    worker.start()  # (off the main thread: lmkv's helper threads, not the OpenMP team)
    worker.join(60)
    assert result == [[True, True, True, False, True, True]]
    want = caches(8, 12, 128, torch.float32)
    scatter_blocks(want, ids, [(i * 256, b) for i, b in enumerate(bufs)], heads_outer=True)
    assert all(torch.equal(g, w) for g, w in zip(bits(got), bits(want), strict=True))


def test_buffers_they_do_not_take_are_left_to_the_caller() -> None:
    """None and nothing copied: a buffer that is not contiguous, one in the
    canonical order, a span past its buffer, caches of another layout."""
    gen = torch.Generator().manual_seed(2)
    buf = chunk(2, 32, torch.float32, gen)
    target = caches(2, 4, 16, torch.float32)
    ids = [0, 1, 2, 3]
    one_layer = chunk(1, 32, torch.float32, gen)  # (contiguous, whatever its layer stride)
    for spans in ([(0, 32, buf.transpose(1, 2), 0)],        # not back to back in order
                  [(0, 32, buf.permute(0, 3, 2, 1, 4).contiguous(), 0)],  # 4 heads, 2 planes
                  [(0, 33, buf, 0)],                         # more tokens than it holds
                  [(0, 32, buf, 1 << 64)],                   # not an xxh3-64
                  [(0, 32, buf[:, :, :, :, :DIM // 2], 0)]):  # another head size
        assert scatter_checked(target, ids, spans) is None
    strided = one_layer.as_strided(one_layer.shape, (1, *one_layer.stride()[1:]))
    assert strided.is_contiguous()
    assert scatter_checked(target[:1], ids, [(0, 32, strided, checksum(one_layer))]) is None
    flash = [torch.zeros(2, 4, 16, HEADS, DIM) for _ in range(2)]
    assert scatter_checked(flash, ids, [(0, 32, buf, checksum(buf))], layout="flash") is None
    assert all(not t.any() for t in target)


def test_a_bad_block_table_copies_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    buf = chunk(2, 32, torch.float32, gen)
    target = caches(2, 4, 16, torch.float32)
    for ids, message in (([0, 9], "copy_checked: block id 9 out of range"),
                         ([0], "copy_checked: the block table does not cover")):
        with pytest.raises(ValueError, match=message):
            scatter_checked(target, ids, [(0, 32, buf, checksum(buf))])
    assert all(not t.any() for t in target)


def test_a_bound_set_serves_checked_copies() -> None:
    gen = torch.Generator().manual_seed(4)
    buf = chunk(2, 32, torch.float32, gen)
    target = caches(2, 4, 16, torch.float32)
    bound = lmkv_kernels.bind(target, "cpu")
    assert scatter_checked(target, [3, 1], [(0, 32, buf, checksum(buf))], layout="cpu",
                           bound=bound) == [True]
    assert torch.equal(target[1][3, 2, :, :DIM], buf[1, 2, :16, 0])
    assert torch.equal(target[0][1, 0, :, DIM:], buf[0, 0, 16:, 1])
