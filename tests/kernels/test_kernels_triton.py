"""The Triton kernels (``lmkv_kernels.triton_impl``) against the torch reference,
bit for bit, on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET=1`` is read when a kernel is decorated (``triton.jit``), that
is when ``triton_impl`` is imported: the fixture sets it and reloads the module,
so its kernel runs on CPU tensors whatever imported it before (and reloads it
again afterwards, unset, so nothing else runs interpreted). Shapes are small:
the interpreter runs a program at a time in Python. No GPU runs here; on a
GPU, ``benchmarks/bench_gpu.py`` checks the same copies against the reference
before it times them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import lmkv_kernels
from lmkv_kernels import LAYOUTS, torch_ref
from lmkv_kernels.layouts import shape_of

pytest.importorskip("triton", reason="Triton is not installed (scripts/setup.sh installs it)")

LAYERS = 2
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def triton_impl() -> Iterator[ModuleType]:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    from lmkv_kernels import triton_impl as module

    try:
        yield importlib.reload(module)
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before
        importlib.reload(module)


def dims(layout: str) -> tuple[int, int, int]:
    """(planes, kv heads, head dim): odd sizes, so no tile is ever full."""
    return (1, 1, 20) if layout == "mla" else (2, 3, 6)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    """Every bit pattern (NaNs too: compared as bits, never as numbers)."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def case(layout: str, dtype: torch.dtype, seed: int):
    """Caches, a shuffled block table of a request with partial blocks, chunks
    of random sizes (their buffers zeroed) and tokens to skip."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    planes, heads, dim = dims(layout)
    block = rng.choice([1, 4, 5, 16])
    first = rng.choice([0, 3, block])  # chunks may start inside a block
    total = rng.randint(1, 40)
    n = -(-(first + total) // block)
    num_blocks = n + rng.randint(0, 4)
    ids = rng.sample(range(num_blocks), n)
    caches = [random_bits(shape_of(layout, num_blocks, block, heads, dim), dtype, gen)
              for _ in range(LAYERS)]
    chunks, start = [], first
    while start < first + total:
        size = min(rng.choice([1, 3, 8, 13]), first + total - start)
        chunks.append((start, torch.zeros(LAYERS, planes, size, heads, dim, dtype=dtype)))
        start += size
    skip = rng.randint(0, first + total)
    return caches, ids, chunks, skip


def scattered_alike(triton_impl: ModuleType, like: list[torch.Tensor],
                    caches: list[torch.Tensor], ids: list[int],
                    got: list[tuple[int, torch.Tensor]], want: list[tuple[int, torch.Tensor]],
                    skip: int, layout: str) -> bool:
    """Triton's scatter of ``got`` into zeroed caches shaped as ``like`` and the
    reference's of ``want`` into zeroed ``caches`` write the same bits."""
    dst = [torch.zeros_like(c) for c in like]
    dst_ref = [torch.zeros_like(c) for c in caches]
    triton_impl.scatter_blocks(dst, ids, got, skip, layout)
    torch_ref.scatter_blocks(dst_ref, ids, want, skip, layout)
    return same(dst, dst_ref)


def fresh(chunks: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    return [(start, torch.zeros_like(buf)) for start, buf in chunks]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(2))
def test_triton_copies_match_the_reference(triton_impl: ModuleType, layout: str,
                                           dtype: torch.dtype, seed: int) -> None:
    caches, ids, chunks, skip = case(layout, dtype, seed + 10 * LAYOUTS.index(layout))
    want, got = fresh(chunks), fresh(chunks)
    torch_ref.gather_blocks(caches, ids, want, layout)
    triton_impl.gather_blocks(caches, ids, got, layout)
    assert same([b for _, b in got], [b for _, b in want])
    assert any(bits(b).any() for _, b in got)  # (the copy did copy)

    table = random.Random(seed).sample(range(caches[0].shape[0] if layout != "flash"
                                             else caches[0].shape[1]), len(ids))
    dst_ref = [c.clone() for c in caches]
    dst = [c.clone() for c in caches]
    torch_ref.scatter_blocks(dst_ref, table, want, skip, layout)
    triton_impl.scatter_blocks(dst, torch.tensor(table), want, skip, layout)
    assert same(dst, dst_ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_copies_strided_caches_and_buffers(triton_impl: ModuleType, layout: str) -> None:
    """Caches in another physical order (FlashInfer's HND is a permuted view) and
    strided buffers (they go through a contiguous buffer)."""
    caches, ids, chunks, skip = case(layout, torch.bfloat16, 5)
    strided = []
    for cache in caches:
        s = torch.empty(cache.shape[::-1], dtype=cache.dtype).permute(
            *range(cache.dim() - 1, -1, -1))
        s.copy_(cache)
        strided.append(s)
    assert not strided[0].is_contiguous()
    want = fresh(chunks)
    torch_ref.gather_blocks(caches, ids, want, layout)
    got = [(start, torch.zeros(buf.shape[1], buf.shape[0], *buf.shape[2:],
                               dtype=buf.dtype).transpose(0, 1)) for start, buf in chunks]
    triton_impl.gather_blocks(strided, ids, got, layout)
    assert same([b for _, b in got], [b for _, b in want])
    assert scattered_alike(triton_impl, strided, caches, ids, got, want, skip, layout)


def test_staged_buffers_go_in_bounded_batches(triton_impl: ModuleType, monkeypatch) -> None:
    """Buffers the kernel cannot address (strided here; pinned host memory on a
    GPU) are staged on the caches' device at most ``STAGING_BYTES`` at a time,
    one launch a batch: the copies stay the reference's, bit for bit."""
    caches, ids, chunks, skip = case("cpu", torch.float32, 7)
    launches = []
    real = triton_impl._launch
    monkeypatch.setattr(triton_impl, "_launch",
                        lambda caches, ids, batch, *a, **k: (launches.append(len(batch)),
                                                             real(caches, ids, batch, *a, **k)))
    largest = max(buf.numel() * buf.element_size() for _, buf in chunks)
    monkeypatch.setattr(triton_impl, "STAGING_BYTES", largest)
    want = fresh(chunks)
    torch_ref.gather_blocks(caches, ids, want, "cpu")
    got = [(start, torch.zeros(buf.shape[1], buf.shape[0], *buf.shape[2:],
                               dtype=buf.dtype).transpose(0, 1)) for start, buf in chunks]
    triton_impl.gather_blocks(caches, ids, got, "cpu")
    assert same([b for _, b in got], [b for _, b in want])
    assert len(launches) > 1 and sum(launches) == len(chunks)
    launches.clear()
    dst, dst_ref = [c.clone() for c in caches], [c.clone() for c in caches]
    triton_impl.scatter_blocks(dst, ids, got, skip, "cpu")
    torch_ref.scatter_blocks(dst_ref, ids, want, skip, "cpu")
    assert same(dst, dst_ref)


def test_the_selector_runs_triton_on_request(triton_impl: ModuleType) -> None:
    """``kernels="triton"`` runs the kernels on CPU tensors (interpreted here)."""
    caches, ids, chunks, _ = case("flash", torch.float16, 3)
    want, got = fresh(chunks), fresh(chunks)
    lmkv_kernels.gather_blocks(caches, ids, want, kernels="torch")
    lmkv_kernels.gather_blocks(caches, ids, got, kernels="triton")
    assert same([b for _, b in got], [b for _, b in want])


def test_layers_with_different_strides_are_refused_in_one_line(triton_impl: ModuleType) -> None:
    caches, ids, chunks, _ = case("flash", torch.float32, 4)
    odd = torch.empty(caches[1].shape[::-1]).permute(*range(caches[1].dim() - 1, -1, -1))
    with pytest.raises(ValueError, match="different strides") as info:
        triton_impl.gather_blocks([caches[0], odd], ids, fresh(chunks), "flash")
    assert "\n" not in str(info.value)


def test_triton_copies_vllm_s_rank_4_mla_page(triton_impl: ModuleType) -> None:
    caches, ids, chunks, skip = case("mla", torch.bfloat16, 6)
    paged = [c[:, None] for c in caches]  # [B, 1, N, latent]
    want, got = fresh(chunks), fresh(chunks)
    torch_ref.gather_blocks(caches, ids, want, "mla")
    triton_impl.gather_blocks(paged, ids, got, "mla")
    assert same([b for _, b in got], [b for _, b in want])
    dst, dst_ref = [torch.zeros_like(c) for c in paged], [torch.zeros_like(c) for c in caches]
    triton_impl.scatter_blocks(dst, ids, got, skip, "mla")
    torch_ref.scatter_blocks(dst_ref, ids, want, skip, "mla")
    assert same([c[:, 0] for c in dst], dst_ref)


def test_rows_move_in_the_widest_words_their_strides_and_addresses_allow(
        triton_impl: ModuleType) -> None:
    def words(cache: torch.Tensor, buf: torch.Tensor) -> tuple[int, int]:
        return triton_impl._words([cache], [buf], cache.stride(), cache.shape[-1])

    bf16 = torch.zeros(2, 4, 16, 2, 8, dtype=torch.bfloat16)  # rows of 16 bytes
    assert words(bf16, torch.zeros(8, dtype=torch.bfloat16)) == (8, 4)
    assert words(bf16[..., :6], torch.zeros(8, dtype=torch.bfloat16)) == (4, 2)
    assert words(bf16, torch.zeros(9, dtype=torch.bfloat16)[1:]) == (2, 1)  # odd address
    assert words(bf16.transpose(3, 4), torch.zeros(8, dtype=torch.bfloat16)) == (2, 1)
    assert words(bf16.view(torch.float8_e4m3fn)[..., :3],
                 torch.zeros(8, dtype=torch.uint8)) == (1, 1)


def test_index_tables_go_to_cuda_pinned_and_non_blocking_on_the_caches_device(
        triton_impl: ModuleType, monkeypatch) -> None:
    """CUDA STUBBED (no GPU here): a table is pinned, then copied without blocking
    (a pageable copy would block the host until the transfer stream, waiting for
    the forward, got there); launches run with the caches' device current. On CPU
    tensors (the interpreter) every table of a launch goes through ``_to_device``."""
    log: list[tuple] = []
    table = torch.arange(4)
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: (log.append(("pin",)), self)[1])
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            log.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    triton_impl._to_device(table, torch.device("cuda", 1))
    assert log == [("pin",), ("to", "cuda:1", True)]
    monkeypatch.setattr(torch.cuda, "device",
                        lambda device: (log.append(("device", str(device))),
                                        contextlib.nullcontext())[1])
    with triton_impl._on_device(torch.device("cuda", 1)):
        pass
    assert log[-1] == ("device", "cuda:1")
    monkeypatch.undo()
    moved: list[torch.device] = []
    real = triton_impl._to_device
    monkeypatch.setattr(triton_impl, "_to_device",
                        lambda t, device: (moved.append(device), real(t, device))[1])
    caches = [torch.randn(4, 2, 16, 2 * 8) for _ in range(2)]  # cpu layout
    buf = torch.empty(2, 2, 16, 2, 8)
    triton_impl.gather_blocks(caches, [3], [(0, buf)], layout="cpu")
    assert moved == [torch.device("cpu")] * 6  # cache_tok, chunk, in_chunk, length, 2 tables
    want = torch.empty_like(buf)
    torch_ref.gather_blocks(caches, [3], [(0, want)], "cpu")
    assert torch.equal(buf, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_copies_heads_outer_buffers_as_the_reference(triton_impl: ModuleType,
                                                            layout: str) -> None:
    """Buffers held ``[layers, heads, tokens, planes, dim]`` (``KVSpec.heads_outer``,
    the order of cpu caches) and viewed in the canonical order: the same bits
    as the reference's own heads-outer path."""
    caches, ids, chunks, skip = case(layout, torch.bfloat16, 9)

    def held(chunks):  # type: ignore[no-untyped-def]
        return [(start, torch.zeros(buf.shape[0], buf.shape[3], buf.shape[2], buf.shape[1],
                                    buf.shape[4], dtype=buf.dtype).permute(0, 3, 2, 1, 4))
                for start, buf in chunks]

    want, got = held(chunks), held(chunks)
    torch_ref.gather_blocks(caches, ids, want, layout)
    triton_impl.gather_blocks(caches, ids, got, layout)
    assert same([b for _, b in got], [b for _, b in want])
    assert scattered_alike(triton_impl, caches, caches, ids, got, want, skip, layout)
