"""lmkv_kernels: the torch reference copies against a token-by-token reference,
the layouts, the implementation chosen per device, and an install that cannot
clash with Hugging Face's ``kernels``. (The Triton kernels against this
reference: ``test_kernels_triton.py``.)"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmkv_kernels
from lmkv_kernels import (
    LAYOUTS,
    gather_blocks,
    geometry,
    host_impl,
    implementation,
    layout_of,
    scatter_blocks,
    torch_ref,
)
from lmkv_kernels.layouts import shape_of
from lmkv_kernels.torch_ref import _pieces, _scatter

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HEADS, DIM, LATENT = 2, 3, 16, 24
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8]


def dims(layout: str) -> tuple[int, int, int]:
    """(planes, kv heads, head dim) of ``layout``'s chunk buffers in these tests."""
    return (1, 1, LATENT) if layout == "mla" else (2, HEADS, DIM)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    if dtype.itemsize == 1:  # every bit pattern (fp8: NaNs too; compared as bits)
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(dtype)


def make_caches(layout: str, num_blocks: int, block: int, dtype: torch.dtype,
                gen: torch.Generator) -> list[torch.Tensor]:
    _, heads, dim = dims(layout)
    shape = shape_of(layout, num_blocks, block, heads, dim)
    return [random_tensor(shape, dtype, gen) for _ in range(LAYERS)]


def token_kv(cache: torch.Tensor, layout: str, ids: list[int], block: int, t: int):
    """K and V ``[heads, dim]`` of token ``t`` (mla: its latent ``[1, latent]``),
    read the obvious way."""
    b, o = ids[t // block], t % block
    if layout == "flash":
        return cache[0, b, o], cache[1, b, o]
    if layout == "flashinfer":
        return cache[b, 0, o], cache[b, 1, o]
    if layout == "mla":
        return (cache[b, o][None],)
    return cache[b, :, o, :DIM], cache[b, :, o, DIM:]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def chunks_of(total: int, sizes: list[int], dtype: torch.dtype,
              layout: str = "flash", heads_outer: bool = False
              ) -> list[tuple[int, torch.Tensor]]:
    """Zeroed buffers ``[layers, planes, tokens, heads, dim]``; ``heads_outer``: views
    of buffers held ``[layers, heads, tokens, planes, dim]`` (``KVSpec.heads_outer``)."""
    planes, heads, dim = dims(layout)
    chunks, start = [], 0
    for size in sizes:
        size = min(size, total - start)
        if size <= 0:
            break
        if heads_outer:
            buf = torch.zeros(LAYERS, heads, size, planes, dim, dtype=dtype).permute(0, 3, 2, 1, 4)
        else:
            buf = torch.zeros(LAYERS, planes, size, heads, dim, dtype=dtype)
        chunks.append((start, buf))
        start += size
    return chunks


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads_outer", [False, True], ids=["l2thd", "lht2d"])
@pytest.mark.parametrize("kernels", ["torch", "host"])
def test_host_round_trip_with_random_block_tables(layout: str, dtype: torch.dtype,
                                                  seed: int, heads_outer: bool,
                                                  kernels: str) -> None:
    """The reference and the C copies (``host``: cpu-layout caches with heads-outer
    buffers in C, the rest by the reference) against a token-by-token read."""
    if kernels == "host" and not host_impl.available():
        pytest.skip("lmkv_kernels' C copies were not built")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block = rng.choice([1, 4, 16, 48])
    total = rng.randint(1, 300)  # most often a partial last block
    n = -(-total // block)
    num_blocks = n + rng.randint(0, 8)
    src_ids = rng.sample(range(num_blocks), n)
    dst_ids = rng.sample(range(num_blocks), n)
    sizes = [rng.choice([1, 7, 16, 64, 100]) for _ in range(total)]
    src = make_caches(layout, num_blocks, block, dtype, gen)
    chunks = chunks_of(total, sizes, dtype, layout, heads_outer)

    gather_blocks(src, src_ids, chunks, layout=layout, kernels=kernels)  # type: ignore[arg-type]
    for start, buf in chunks:
        for i in range(buf.shape[2]):
            for layer in range(LAYERS):
                kv = token_kv(src[layer], layout, src_ids, block, start + i)
                for plane, want in enumerate(kv):
                    assert torch.equal(bits(buf[layer, plane, i]), bits(want))

    skip = rng.randint(0, total)
    dst = make_caches(layout, num_blocks, block, dtype, gen)
    before = [c.clone() for c in dst]
    scatter_blocks(dst, torch.tensor(dst_ids), chunks, skip_tokens=skip, layout=layout,
                   kernels=kernels)  # type: ignore[arg-type]
    written = torch.zeros(num_blocks, block, dtype=torch.bool)
    for t in range(skip, total):
        written[dst_ids[t // block], t % block] = True
        for layer in range(LAYERS):
            got = token_kv(dst[layer], layout, dst_ids, block, t)
            want = token_kv(src[layer], layout, src_ids, block, t)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))
    for layer in range(LAYERS):  # every other slot as it was
        for b, o in (~written).nonzero().tolist():
            got = token_kv(dst[layer], layout, list(range(num_blocks)), block, b * block + o)
            old = token_kv(before[layer], layout, list(range(num_blocks)), block,
                           b * block + o)
            assert all(torch.equal(bits(x), bits(y)) for x, y in zip(got, old, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_copies_strided_caches_and_buffers(layout: str) -> None:
    gen = torch.Generator().manual_seed(7)
    block, total = 16, 70
    ids = [5, 2, 7, 0, 3]
    planes, heads, dim = dims(layout)
    dense = make_caches(layout, 8, block, torch.float32, gen)
    strided = [torch.empty(c.shape[::-1]).permute(*range(c.dim() - 1, -1, -1)) for c in dense]
    for s, d in zip(strided, dense, strict=True):
        s.copy_(d)
    assert not strided[0].is_contiguous()
    buf = torch.empty(planes, LAYERS, total, heads, dim).transpose(0, 1)  # strided
    gather_blocks(strided, ids, [(0, buf)], layout=layout)
    want = torch.zeros(LAYERS, planes, total, heads, dim)
    gather_blocks(dense, ids, [(0, want)], layout=layout)
    assert torch.equal(buf, want)
    out = [torch.zeros_like(c) for c in strided]
    scatter_blocks(out, ids, [(0, buf)], layout=layout)
    back = torch.zeros(LAYERS, planes, total, heads, dim)
    gather_blocks(out, ids, [(0, back)], layout=layout)
    assert torch.equal(back, want)


def test_layouts_are_read_from_the_shape_where_it_tells_them_apart() -> None:
    flash = torch.zeros(2, 10, 16, HEADS, DIM)
    flashinfer = torch.zeros(10, 2, 16, HEADS, DIM)
    cpu = torch.zeros(10, HEADS, 16, 2 * DIM)
    mla = torch.zeros(10, 16, LATENT)
    assert [layout_of(c) for c in (flash, flashinfer, cpu, mla)] == list(LAYOUTS)
    assert geometry(flash) == geometry(cpu).__class__("flash", 10, 16, HEADS, DIM)
    assert geometry(flashinfer) == geometry(cpu).__class__("flashinfer", 10, 16, HEADS, DIM)
    assert geometry(mla) == geometry(cpu).__class__("mla", 10, 16, 1, LATENT)
    for cache in (flash, flashinfer, cpu, mla):
        assert geometry(cache).shape == tuple(cache.shape)
        assert geometry(cache, layout_of(cache)) == geometry(cache)
    assert geometry(mla).planes == 1 and geometry(cpu).planes == 2
    for bad in (torch.zeros(3, 10, 16, HEADS, DIM), torch.zeros(10, HEADS, 16, 7),
                torch.zeros(10, 16), torch.zeros(1, 2, 3, 4, 5, 6)):
        with pytest.raises(ValueError, match=r"expected a layout of flash .*; mla") as info:
            geometry(bad)
        assert "\n" not in str(info.value)


def test_a_shape_both_flash_and_flashinfer_fit_needs_its_layout_named() -> None:
    both = torch.zeros(2, 2, 16, HEADS, DIM)  # 2 blocks of either
    with pytest.raises(ValueError, match="could be the flash or the flashinfer layout: "
                                         "name its layout") as info:
        geometry(both)
    assert "\n" not in str(info.value)
    assert geometry(both, "flash").num_blocks == geometry(both, "flashinfer").num_blocks == 2
    with pytest.raises(ValueError, match="the mla layout is \\[num_blocks, block_size"):
        geometry(both, "mla")
    with pytest.raises(ValueError, match="layout 'paged': expected one of flash, flashinfer"):
        geometry(both, "paged")  # type: ignore[arg-type]


def test_a_named_layout_decides_where_the_shape_cannot() -> None:
    """Two blocks of flashinfer, copied as flashinfer (as flash, the K of block 1
    would be read from the V of block 0)."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 2, 4, HEADS, DIM, generator=gen)
    buf = torch.zeros(1, 2, 8, HEADS, DIM)
    gather_blocks([cache], [1, 0], [(0, buf)], layout="flashinfer")
    assert torch.equal(buf[0, 0, :4], cache[1, 0]) and torch.equal(buf[0, 1, 4:], cache[0, 1])


def test_the_reference_serves_whatever_triton_and_c_cannot(monkeypatch) -> None:
    monkeypatch.delenv("LMKV_KERNELS", raising=False)
    host = host_impl if host_impl.available() else torch_ref
    assert implementation(torch.device("cpu")) is host
    assert implementation("cpu", "auto") is host
    assert implementation("cpu", "torch") is torch_ref
    assert implementation("cuda", "torch") is torch_ref
    monkeypatch.setenv("LMKV_KERNELS", "torch")
    assert implementation("cuda") is torch_ref
    monkeypatch.setattr(lmkv_kernels, "triton_available", lambda: False)
    monkeypatch.delenv("LMKV_KERNELS")
    assert implementation("cuda") is torch_ref  # no Triton: the reference, silently
    with pytest.raises(ValueError, match="'triton' but Triton is not installed"):
        implementation("cuda", "triton")
    monkeypatch.setattr(host_impl, "_host", None)  # built without a C compiler
    assert implementation("cpu") is torch_ref
    with pytest.raises(ValueError, match=r"^kernels = 'host' but lmkv_kernels' C copies "
                                         r"were not built \(reinstall lmkv with a C "
                                         r"compiler\)$"):
        implementation("cpu", "host")


def test_cuda_caches_get_triton_where_it_is_installed(monkeypatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (scripts/setup.sh "
                                          "installs it)")
    monkeypatch.delenv("LMKV_KERNELS", raising=False)
    assert implementation("cuda").__name__ == "lmkv_kernels.triton_impl"
    assert implementation("cpu", "triton").__name__ == "lmkv_kernels.triton_impl"
    monkeypatch.setenv("LMKV_KERNELS", "triton")
    assert implementation("cpu").__name__ == "lmkv_kernels.triton_impl"


def test_an_unknown_choice_is_one_line(monkeypatch) -> None:
    monkeypatch.setenv("LMKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"^LMKV_KERNELS = 'cuda': expected one of auto, "
                                         r"triton, host, torch$"):
        implementation("cpu")
    with pytest.raises(ValueError, match=r"^kernels = 'fast': expected one of"):
        implementation("cpu", "fast")  # type: ignore[arg-type]


def test_copies_whole_runs_of_consecutive_blocks_at_once() -> None:
    # (first block, blocks, first offset, tokens per block, first token)
    assert _pieces(0, 400, [4, 5, 6, 9, 10], 96) == [
        (4, 3, 0, 96, 0), (9, 1, 0, 96, 288), (10, 1, 0, 16, 384)]
    assert _pieces(100, 300, [4, 5, 6, 7], 96) == [
        (5, 1, 4, 92, 100), (6, 1, 0, 96, 192), (7, 1, 0, 12, 288)]


def test_heads_outer_buffers_move_whole_cpu_blocks_as_rows(monkeypatch) -> None:
    """cpu caches and heads-outer buffers (``KVSpec.heads_outer``): whole blocks go
    by index, one gather or scatter a layer whatever the block table, partial
    blocks by a copy each; any other buffer order or layout goes the general way."""
    g = geometry(torch.zeros(8, HEADS, 16, 2 * DIM), "cpu")
    held = torch.zeros(LAYERS, HEADS, 64, 2, DIM)
    view = held.permute(0, 3, 2, 1, 4)
    assert torch_ref._head_runs(view, g).data_ptr() == held.data_ptr()
    assert torch_ref._head_runs(view[:, :, 16:48], g) is not None
    assert torch_ref._head_runs(torch.zeros(LAYERS, 2, 64, HEADS, DIM), g) is None
    assert torch_ref._head_runs(view, geometry(torch.zeros(2, 8, 16, HEADS, DIM),
                                               "flash")) is None
    caches = [torch.randn(8, HEADS, 16, 2 * DIM) for _ in range(LAYERS)]
    calls = []

    def counted(name, real):  # type: ignore[no-untyped-def]
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    copy_all = torch_ref._copy_all
    monkeypatch.setattr(torch_ref, "_copy_all",  # one call copies a run in every layer
                        lambda dst, src: calls.append(f"copy x{len(dst)}") or copy_all(dst, src))
    monkeypatch.setattr(torch_ref, "_scatter", counted("scatter", torch_ref._scatter))
    monkeypatch.setattr(torch, "index_select", counted("gather", torch.index_select))
    ids = [2, 7, 4, 6]  # scattered
    scatter_blocks(caches, ids, [(0, view)], layout="cpu", kernels="torch")
    assert calls == ["scatter"] * LAYERS
    calls.clear()
    gather_blocks(caches, ids, [(0, view)], layout="cpu", kernels="torch")
    assert calls == ["gather"] * LAYERS
    calls.clear()
    scatter_blocks(caches, ids, [(0, view)], skip_tokens=8, layout="cpu", kernels="torch")
    # block 2's second half: one copy of every layer's part; blocks 7, 4, 6 are
    # not the chunk's heads back to back any more: a scatter a head and layer
    assert sorted(calls) == [f"copy x{LAYERS}"] + ["scatter"] * LAYERS * HEADS
    calls.clear()
    scatter_blocks(caches, [2, 3, 4, 6], [(0, view)], layout="cpu", kernels="torch")
    assert calls == [f"copy x{LAYERS}"] * 2  # two runs of consecutive blocks: a call each


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach-copy", "copy-loop"])
@pytest.mark.parametrize("ids,skip", [([2, 3, 4, 6], 0), ([2, 3, 4, 6], 8), ([5, 6], 3),
                                      ([7, 1, 4, 6], 21)])
def test_heads_outer_runs_copy_every_layer_bit_for_bit(monkeypatch, foreach: bool,
                                                       ids: list[int], skip: int) -> None:
    """The copies of runs of blocks (every layer's part in one call, or a loop where
    torch lacks ``_foreach_copy_``) move what the canonical path moves."""
    if not foreach:
        monkeypatch.setattr(torch_ref, "_FOREACH_COPY", None)
    gen = torch.Generator().manual_seed(len(ids) + skip)
    tokens = 16 * len(ids) - 5  # a partial last block
    caches = [torch.randn(8, HEADS, 16, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    outer = torch.zeros(LAYERS, HEADS, tokens, 2, DIM).permute(0, 3, 2, 1, 4)
    want = torch.zeros(LAYERS, 2, tokens, HEADS, DIM)
    gather_blocks(caches, ids, [(0, outer)], layout="cpu", kernels="torch")
    gather_blocks(caches, ids, [(0, want)], layout="cpu", kernels="torch")
    assert torch.equal(outer, want)
    out = [torch.randn(8, HEADS, 16, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    expected = [o.clone() for o in out]
    scatter_blocks(out, ids, [(0, outer)], skip_tokens=skip, layout="cpu", kernels="torch")
    scatter_blocks(expected, ids, [(0, want)], skip_tokens=skip, layout="cpu", kernels="torch")
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))


def test_one_call_takes_heads_outer_and_canonical_chunks_together() -> None:
    """A heads-outer chunk's copies leave the canonical path's row tables alone: a
    canonical chunk after it in the same call is copied too, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(8, HEADS, 16, 2 * DIM, generator=gen) for _ in range(LAYERS)]
    ids = [5, 2, 7, 0, 3, 6]  # three blocks a chunk, none consecutive: the scatter path
    outer = torch.zeros(LAYERS, HEADS, 48, 2, DIM).permute(0, 3, 2, 1, 4)
    canonical = torch.zeros(LAYERS, 2, 48, HEADS, DIM)
    gather_blocks(caches, ids, [(0, outer), (48, canonical)], layout="cpu", kernels="torch")
    want = torch.zeros(LAYERS, 2, 96, HEADS, DIM)
    gather_blocks(caches, ids, [(0, want)], layout="cpu", kernels="torch")
    assert torch.equal(outer, want[:, :, :48]) and torch.equal(canonical, want[:, :, 48:])
    out = [torch.zeros_like(c) for c in caches]
    scatter_blocks(out, ids, [(0, outer), (48, canonical)], layout="cpu", kernels="torch")
    assert all(torch.equal(o[ids], c[ids]) for o, c in zip(out, caches, strict=True))


@pytest.mark.parametrize("head_dim,offset", [(8, 0), (8, 1), (4, 0)])
def test_scatter_moves_rows_bit_for_bit(head_dim: int, offset: int) -> None:
    """Rows go as 16-byte elements when their size and alignment allow, else as they are."""
    source = torch.randn(3 * head_dim + offset).to(torch.bfloat16)[offset:].view(3, head_dim)
    rows = torch.zeros(6, head_dim, dtype=torch.bfloat16)
    _scatter(rows, torch.tensor([4, 0, 2]), source)
    assert torch.equal(bits(rows[[4, 0, 2]]), bits(source))
    assert torch.all(rows[[1, 3, 5]] == 0)


# -- the import name -------------------------------------------------------------------------

def test_lmkv_installs_lmkv_kernels_and_no_top_level_kernels() -> None:
    """What setuptools installs (wheel and editable alike) per pyproject.toml."""
    from setuptools import find_namespace_packages

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    packages = {name for where in find["where"]
                for name in find_namespace_packages(str(ROOT / where), include=find["include"])}
    assert "lmkv_kernels" in packages
    tops = {name.split(".")[0] for name in packages}
    assert "kernels" not in tops
    assert all(top.startswith("lmkv") for top in tops), tops


@pytest.mark.slow  # a fresh interpreter
def test_lmkv_kernels_imports_torch_and_the_standard_library_only() -> None:
    code = ("import sys, lmkv_kernels; "
            "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('lmkv')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert set(eval(out)) - {"lmkv_kernels._native", "lmkv_kernels._native._host"} == {
        "lmkv_kernels", "lmkv_kernels.host_impl", "lmkv_kernels.layouts",
        "lmkv_kernels.torch_ref"}


@pytest.mark.slow  # a fresh interpreter
def test_lmkv_kernels_imports_without_triton() -> None:
    """Triton is optional: with it hidden, lmkv_kernels and the paged connector
    import and copy with the reference, even for CUDA caches."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import lmkv_kernels, lmkv_backends.connectors.paged\n"
            "print(lmkv_kernels.implementation('cuda').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["lmkv_kernels.torch_ref"]


def test_the_example_in_docs_kernels_md_runs() -> None:
    import re

    text = (ROOT / "docs" / "kernels.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(block, "docs/kernels.md", "exec"), {})


def test_vllm_s_rank_4_mla_page_is_copied_as_the_rank_3_form() -> None:
    """vLLM's logical ``[B, 1, N, latent]`` MLA page: the same copies once named
    (by shape it reads as the cpu layout with one head)."""
    gen = torch.Generator().manual_seed(11)
    flat = make_caches("mla", 6, 4, torch.bfloat16, gen)
    paged = [c[:, None] for c in flat]
    assert layout_of(paged[0]) == "cpu" and geometry(paged[0], "mla") == geometry(flat[0])
    ids = [4, 0, 5]
    want, got = chunks_of(11, [5, 6], torch.bfloat16, "mla"), chunks_of(11, [5, 6],
                                                                         torch.bfloat16, "mla")
    gather_blocks(flat, ids, want)
    gather_blocks(paged, ids, got, layout="mla")
    assert all(torch.equal(bits(a), bits(b)) for (_, a), (_, b) in zip(got, want, strict=True))
    out = [torch.zeros_like(c) for c in paged]
    scatter_blocks(out, ids, got, skip_tokens=2, layout="mla")
    ref = [torch.zeros_like(c) for c in flat]
    scatter_blocks(ref, ids, want, skip_tokens=2)
    assert all(torch.equal(bits(a[:, 0]), bits(b)) for a, b in zip(out, ref, strict=True))


def test_lmkv_kernels_is_no_config_key() -> None:
    """``LMKV_*`` variables are config keys, except the reserved ones."""
    from lmkv.config.model import KERNELS_ENV, load_config

    assert KERNELS_ENV == lmkv_kernels.ENV
    load_config(env={"LMKV_KERNELS": "torch"})  # no "unknown key 'kernels'"
