from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmkv.contracts.connector import ChunkSpan, ConnectorContext, KVSpec
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.connectors.paged import PagedConnector

L, H, D = 3, 2, 8
SPEC = KVSpec(L, H, D, torch.float32)


def spans_for(total: int, chunk: int) -> list[ChunkSpan]:
    return [ChunkSpan(s, min(s + chunk, total),
                      torch.empty(SPEC.chunk_shape(min(chunk, total - s))))
            for s in range(0, total, chunk)]


def reference_chunk(k: list[torch.Tensor], v: list[torch.Tensor], s: int, e: int):
    """Canonical [L, 2, T, H, D] from per-layer [T_total, H, D] K and V."""
    return torch.stack([torch.stack([k[i][s:e], v[i][s:e]]) for i in range(L)])


@pytest.mark.parametrize("total,chunk", [(64, 16), (70, 16), (5, 16)])
def test_hf_round_trip(total: int, chunk: int) -> None:
    kv = [(torch.randn(2, H, total, D), torch.randn(2, H, total, D)) for _ in range(L)]
    conn = HFConnector(None, ConnectorContext(SPEC))
    spans = spans_for(total, chunk)
    conn.to_chunks(spans, kv=kv, batch_index=1)
    ks = [k[1].transpose(0, 1) for k, _ in kv]
    vs = [v[1].transpose(0, 1) for _, v in kv]
    for span in spans:
        assert torch.equal(span.buffer, reference_chunk(ks, vs, span.start, span.end))
    rebuilt = conn.from_chunks(spans)
    for (k, v), (rk, rv) in zip(kv, rebuilt, strict=True):
        assert torch.equal(rk[0], k[1]) and torch.equal(rv[0], v[1])
    # into existing tensors
    target = [(torch.zeros(1, H, total, D), torch.zeros(1, H, total, D)) for _ in range(L)]
    conn.from_chunks(spans[:1], kv=target)
    n = spans[0].end
    assert torch.equal(target[0][0][0, :, :n], kv[0][0][1, :, :n])
    assert torch.all(target[0][0][0, :, n:] == 0)


def make_paged(layout: str, num_blocks: int, block: int):
    if layout == "flash":
        return [torch.randn(2, num_blocks, block, H, D) for _ in range(L)]
    return [torch.randn(num_blocks, H, block, 2 * D) for _ in range(L)]


def token_kv(caches, layout: str, block_ids: list[int], block: int, total: int):
    """Per-layer [T, H, D] K and V read token by token: the slow, obvious way."""
    ks, vs = [], []
    for cache in caches:
        k_rows, v_rows = [], []
        for t in range(total):
            b, o = block_ids[t // block], t % block
            if layout == "flash":
                k_rows.append(cache[0, b, o])
                v_rows.append(cache[1, b, o])
            else:
                k_rows.append(cache[b, :, o, :D])
                v_rows.append(cache[b, :, o, D:])
        ks.append(torch.stack(k_rows))
        vs.append(torch.stack(v_rows))
    return ks, vs


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("total,chunk,block", [(64, 16, 16), (100, 32, 16), (40, 32, 128),
                                              (70, 24, 16)])
def test_paged_round_trip(layout: str, total: int, chunk: int, block: int) -> None:
    num_blocks = 12
    n_req_blocks = -(-total // block)
    block_ids = torch.randperm(num_blocks)[:n_req_blocks].tolist()
    caches = make_paged(layout, num_blocks, block)
    conn = PagedConnector(None, ConnectorContext(SPEC))
    spans = spans_for(total, chunk)
    conn.to_chunks(spans, kv_caches=caches, block_ids=block_ids)
    ks, vs = token_kv(caches, layout, block_ids, block, total)
    for span in spans:
        assert torch.equal(span.buffer, reference_chunk(ks, vs, span.start, span.end))

    # load into a different cache with a different block table: same KV per token
    other = [torch.zeros_like(c) for c in caches]
    other_ids = list(reversed(range(num_blocks)))[:n_req_blocks]
    conn.from_chunks(spans, kv_caches=other, block_ids=other_ids)
    ks2, vs2 = token_kv(other, layout, other_ids, block, total)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert torch.equal(a, b)
    # blocks the request does not own are untouched
    untouched = [b for b in range(num_blocks) if b not in other_ids[:n_req_blocks]]
    for cache in other:
        region = cache[:, untouched] if layout == "flash" else cache[untouched]
        assert torch.all(region == 0)


def test_flash_and_cpu_layouts_exchange_kv() -> None:
    """KV stored from a FlashAttention-layout cache loads into a CPU-layout one."""
    total, block = 48, 16
    flash = make_paged("flash", 4, block)
    spans = spans_for(total, 16)
    PagedConnector(None, ConnectorContext(SPEC)).to_chunks(
        spans, kv_caches=flash, block_ids=[2, 0, 1])
    cpu = [torch.zeros(4, H, block, 2 * D) for _ in range(L)]
    PagedConnector(None, ConnectorContext(SPEC)).from_chunks(
        spans, kv_caches=cpu, block_ids=[3, 1, 0])
    ks, vs = token_kv(flash, "flash", [2, 0, 1], block, total)
    ks2, vs2 = token_kv(cpu, "cpu", [3, 1, 0], block, total)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("skip", [0, 16, 20, 40, 70])
def test_paged_from_chunks_skips_tokens_the_engine_holds(layout: str, skip: int) -> None:
    total, block, num_blocks = 70, 16, 8
    block_ids = [5, 2, 7, 0, 3]
    src = make_paged(layout, num_blocks, block)
    spans = spans_for(total, 24)
    conn = PagedConnector(None, ConnectorContext(SPEC))
    conn.to_chunks(spans, kv_caches=src, block_ids=block_ids)
    dst = [torch.zeros_like(c) for c in src]
    conn.from_chunks(spans, kv_caches=dst, block_ids=block_ids, skip_tokens=skip)
    ks, vs = token_kv(src, layout, block_ids, block, total)
    ks2, vs2 = token_kv(dst, layout, block_ids, block, total)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert torch.all(b[:skip] == 0)
        assert torch.equal(a[skip:], b[skip:])


# -- paged copies against a token-by-token reference, all paths ---------------------------------

PAGED = KVSpec(2, 3, 16, torch.float32)


def paged_caches(layout: str, num_blocks: int, block: int, dtype: torch.dtype,
                 contiguous: bool = True) -> list[torch.Tensor]:
    h, d = PAGED.num_kv_heads, PAGED.head_dim
    if layout == "flash":
        shape, order = (num_blocks, 2, block, h, d), (1, 0, 2, 3, 4)
    else:
        shape, order = (h, num_blocks, block, 2 * d), (1, 0, 2, 3)
    caches = [torch.randn(shape).to(dtype) for _ in range(PAGED.num_layers)]
    caches = [c.permute(order) for c in caches]  # the cache shape, not contiguous
    return [c.contiguous() for c in caches] if contiguous else caches


def block_table(kind: str, n: int, num_blocks: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "consecutive":
        first = int(torch.randint(0, num_blocks - n + 1, (1,), generator=gen))
        return list(range(first, first + n))
    if kind == "shuffled":
        return torch.randperm(num_blocks, generator=gen)[:n].tolist()
    # "runs": runs of 1-4 consecutive ids in random order
    cuts = torch.randint(1, 5, (num_blocks,), generator=gen).cumsum(0).tolist()
    starts = [0, *[c for c in cuts if c < num_blocks]]
    runs = [list(range(a, b)) for a, b in zip(starts, [*starts[1:], num_blocks], strict=True)]
    order = torch.randperm(len(runs), generator=gen).tolist()
    return [b for i in order for b in runs[i]][:n]


def token_index(caches: list[torch.Tensor], layout: str, ids: list[int], block: int,
                total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V as [T, H, D], each token picked at its (block, offset)."""
    t = torch.arange(total)
    b, o = torch.tensor(ids)[t // block], t % block
    d = PAGED.head_dim
    if layout == "flash":
        return [(c[0, b, o], c[1, b, o]) for c in caches]
    return [(c[b, :, o, :d], c[b, :, o, d:]) for c in caches]


def write_tokens(caches: list[torch.Tensor], layout: str, ids: list[int], block: int,
                 kv: list[tuple[torch.Tensor, torch.Tensor]], first: int) -> None:
    """Write tokens ``first..`` of per-layer [T, H, D] K and V at (block, offset)."""
    t = torch.arange(first, kv[0][0].shape[0])
    b, o = torch.tensor(ids)[t // block], t % block
    d = PAGED.head_dim
    for cache, (k, v) in zip(caches, kv, strict=True):
        if layout == "flash":
            cache[0, b, o], cache[1, b, o] = k[first:], v[first:]
        else:
            cache[b, :, o, :d], cache[b, :, o, d:] = k[first:], v[first:]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_paged(layout: str, dtype: torch.dtype, total: int, chunk: int, block: int,
                skip: int, table: str, contiguous: bool = True, tensor_ids: bool = False) -> None:
    spec = KVSpec(PAGED.num_layers, PAGED.num_kv_heads, PAGED.head_dim, dtype)
    conn = PagedConnector(None, ConnectorContext(spec))
    n = -(-total // block)
    num_blocks = 2 * n + 3
    src_ids = block_table(table, n, num_blocks, seed=1)
    dst_ids = block_table(table, n, num_blocks, seed=2)
    src = paged_caches(layout, num_blocks, block, dtype, contiguous)
    spans = []
    for s in range(0, total, chunk):
        shape = spec.chunk_shape(min(chunk, total - s))
        buf = torch.full(shape, float("nan"), dtype=dtype)
        if not contiguous:  # a buffer with the chunk shape, not contiguous
            buf = torch.empty(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)
        spans.append(ChunkSpan(s, min(s + chunk, total), buf))

    conn.to_chunks(spans, kv_caches=src,
                   block_ids=torch.tensor(src_ids) if tensor_ids else src_ids)
    kv = token_index(src, layout, src_ids, block, total)
    for span in spans:
        expected = torch.stack([torch.stack([k[span.start:span.end], v[span.start:span.end]])
                                for k, v in kv])
        assert torch.equal(bits(span.buffer), bits(expected))

    dst = paged_caches(layout, num_blocks, block, dtype, contiguous)
    expected = [c.clone() for c in dst]
    write_tokens(expected, layout, dst_ids, block, kv, skip)
    conn.from_chunks(spans, kv_caches=dst, skip_tokens=skip,
                     block_ids=torch.tensor(dst_ids) if tensor_ids else dst_ids)
    # the loaded tokens are bit-identical; tokens before skip_tokens, the rest of
    # the last block and blocks outside the table are untouched
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("table", ["consecutive", "runs", "shuffled"])
@pytest.mark.parametrize("total,chunk,block,skip", [
    (1000, 256, 96, 0),  # chunks straddle blocks; partial last chunk and last block
    (1000, 256, 96, 192),  # skip_tokens on a block boundary
    (1000, 256, 96, 200),  # ... inside a block
    (1000, 256, 96, 256),  # ... on a chunk boundary
    (1024, 256, 128, 0),  # chunks of whole blocks
    (1000, 256, 128, 300),
    (200, 64, 16, 37),
    (1000, 256, 16, 100),  # small blocks: scattered with index_copy_ when fragmented
])
def test_paged_copies_match_token_by_token(layout: str, dtype: torch.dtype, table: str,
                                           total: int, chunk: int, block: int,
                                           skip: int) -> None:
    check_paged(layout, dtype, total, chunk, block, skip, table)


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_copies_with_strided_caches_and_buffers(layout: str, dtype: torch.dtype) -> None:
    check_paged(layout, dtype, 1000, 256, 96, 100, "runs", contiguous=False)


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_paged_block_ids_as_a_tensor(layout: str) -> None:
    check_paged(layout, torch.bfloat16, 1000, 256, 96, 100, "runs", tensor_ids=True)


# -- the paged connector reads the layout from the caches ---------------------------------------

@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_paged_connector_reads_the_spec_from_the_caches(layout: str) -> None:
    """cpu caches' chunks are held heads outer (``lht2d``), the caches' own order."""
    caches = make_paged(layout, 5, 16)
    spec = PagedConnector.spec_from(kv_caches=caches)
    assert spec == replace(SPEC, heads_outer=layout == "cpu")
    assert spec.chunk_shape(7) == ((L, H, 7, 2, D) if layout == "cpu" else (L, 2, 7, H, D))
    assert PagedConnector(None, ConnectorContext(spec)).chunk_layout == spec.chunk_layout \
        == ("lht2d" if layout == "cpu" else "l2thd")


@pytest.mark.parametrize("total,chunk,block", [(64, 16, 16), (100, 32, 16), (70, 24, 16),
                                              (40, 32, 128)])
def test_heads_outer_chunks_hold_the_same_kv_in_the_caches_order(total: int, chunk: int,
                                                                   block: int) -> None:
    """A heads-outer spec's chunks are the canonical chunks with heads and planes
    swapped in memory, bit for bit; they load back into cpu and flash caches alike."""
    spec = replace(SPEC, heads_outer=True)
    caches = make_paged("cpu", 12, block)
    ids = torch.randperm(12)[:-(-total // block)].tolist()
    canonical = spans_for(total, chunk)
    PagedConnector(None, ConnectorContext(SPEC)).to_chunks(canonical, kv_caches=caches,
                                                           block_ids=ids)
    outer = [ChunkSpan(s.start, s.end, torch.empty(spec.chunk_shape(s.end - s.start)))
             for s in canonical]
    conn = PagedConnector(None, ConnectorContext(spec))
    conn.to_chunks(outer, kv_caches=caches, block_ids=ids)
    for a, b in zip(canonical, outer, strict=True):
        assert b.buffer.is_contiguous()
        assert torch.equal(a.buffer.permute(0, 3, 2, 1, 4), b.buffer)
        assert spec.planes_first(b.buffer).data_ptr() == b.buffer.data_ptr()
    for layout in ("cpu", "flash"):
        other = make_paged(layout, 12, block)
        other = [torch.zeros_like(c) for c in other]
        back = list(reversed(range(12)))[:len(ids)]
        conn.from_chunks(outer, kv_caches=other, block_ids=back)
        ks, vs = token_kv(caches, "cpu", ids, block, total)
        ks2, vs2 = token_kv(other, layout, back, block, total)
        assert all(torch.equal(x, y) for x, y in zip(ks + vs, ks2 + vs2, strict=True))


def test_paged_connector_refuses_caches_in_no_known_layout() -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 5, 16, 2, 8\).*flash.*cpu") as info:
        PagedConnector.spec_from(kv_caches=[torch.zeros(3, 5, 16, 2, 8)])
    assert "\n" not in str(info.value)


def test_paged_connector_checks_caches_against_its_spec() -> None:
    conn = PagedConnector(None, ConnectorContext(SPEC))
    span = spans_for(16, 16)
    wrong = [torch.zeros(2, 4, 16, H + 1, D) for _ in range(L)]
    with pytest.raises(ValueError, match="flash layout"):
        conn.to_chunks(span, kv_caches=wrong, block_ids=[0])
    with pytest.raises(ValueError, match="cannot hold 16 tokens"):
        conn.to_chunks(span, kv_caches=make_paged("cpu", 4, 8), block_ids=[0])


def test_paged_connector_checks_each_set_of_caches_it_is_given() -> None:
    """Sets of caches checked once are remembered by each cache's address, shape,
    strides and dtype: sets taken in turn each get their own KV, and a cache
    replaced in its list by a wrong one is refused like any wrong set."""
    spec = replace(SPEC, heads_outer=True)
    conn = PagedConnector(None, ConnectorContext(spec))
    spans = [ChunkSpan(0, 32, torch.randn(spec.chunk_shape(32)))]
    sets = [[torch.zeros(8, H, 16, 2 * D) for _ in range(L)] for _ in range(2)]
    for turn in range(4):
        caches = sets[turn % 2]
        conn.from_chunks(spans, kv_caches=caches, block_ids=[turn, 7 - turn])
        back = [ChunkSpan(0, 32, torch.zeros(spec.chunk_shape(32)))]
        conn.to_chunks(back, kv_caches=caches, block_ids=[turn, 7 - turn])
        assert torch.equal(back[0].buffer, spans[0].buffer)
    sets[0][1] = torch.zeros(8, H, 16, 2 * D, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"KV dtype torch\.float16; expected torch\.float32"):
        conn.from_chunks(spans, kv_caches=sets[0], block_ids=[0, 1])


def test_a_cache_given_new_storage_in_place_is_bound_again() -> None:
    """The last set is known again by its very tensors at their addresses: a cache
    moved to other storage in place (``set_``) is checked and bound anew, and its
    KV goes to its new memory, never to the storage it left."""
    spec = replace(SPEC, heads_outer=True)
    conn = PagedConnector(None, ConnectorContext(spec))
    spans = [ChunkSpan(0, 32, torch.randn(spec.chunk_shape(32)))]
    caches = [torch.zeros(8, H, 16, 2 * D) for _ in range(L)]
    conn.from_chunks(spans, kv_caches=caches, block_ids=[0, 1])
    left = caches[1][:]  # (a view: the storage caches[1] leaves)
    before = left.clone()
    caches[1].set_(torch.zeros(8, H, 16, 2 * D))  # same tensor object, other memory
    conn.from_chunks(spans, kv_caches=caches, block_ids=[2, 3])
    back = [ChunkSpan(0, 32, torch.zeros(spec.chunk_shape(32)))]
    conn.to_chunks(back, kv_caches=caches, block_ids=[2, 3])
    assert torch.equal(back[0].buffer, spans[0].buffer)
    assert torch.equal(left, before)
    caches[0].set_(torch.zeros(4, H, 16, 2 * D))  # fewer blocks, in place
    with pytest.raises(ValueError, match="KV caches of shapes"):
        conn.from_chunks(spans, kv_caches=caches, block_ids=[0, 1])


def test_connectors_that_cannot_read_a_spec_say_so() -> None:
    with pytest.raises(NotImplementedError, match="'hf'"):
        HFConnector.spec_from(kv=[])


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("bad", [-1, 4, 7])
def test_block_ids_outside_the_caches_are_refused(layout: str, bad: int) -> None:
    """A negative id would wrap to the last block, a large one into another block's
    rows: both would copy KV of another request. Nothing is copied."""
    block = 16
    caches = make_paged(layout, 4, block)
    before = [c.clone() for c in caches]
    conn = PagedConnector(None, ConnectorContext(SPEC))
    spans = spans_for(2 * block, 16)
    for ids in ([0, bad], torch.tensor([0, bad])):
        with pytest.raises(ValueError, match="out of range: the caches hold 4 blocks"):
            conn.from_chunks(spans, kv_caches=caches, block_ids=ids)
        with pytest.raises(ValueError, match="out of range"):
            conn.to_chunks(spans, kv_caches=caches, block_ids=ids)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    conn.to_chunks(spans, kv_caches=caches, block_ids=[0, 3, bad])  # beyond `end`: unused


# -- every lmkv_kernels layout through the one paged connector ---------------------------------

def test_flash_kv_loads_into_a_flashinfer_cache_named_by_the_integration() -> None:
    """The integration names the layout (``ConnectorContext.kv_layout``): a 2-block
    flashinfer cache, whose shape flash would fit as well, is copied as flashinfer."""
    total, block = 24, 16
    flash = make_paged("flash", 4, block)
    spans = spans_for(total, 16)
    PagedConnector(None, ConnectorContext(SPEC)).to_chunks(spans, kv_caches=flash,
                                                           block_ids=[2, 0])
    flashinfer = [torch.zeros(2, 2, block, H, D) for _ in range(L)]
    with pytest.raises(ValueError, match="could be the flash or the flashinfer layout"):
        PagedConnector(None, ConnectorContext(SPEC)).from_chunks(
            spans, kv_caches=flashinfer, block_ids=[1, 0])
    for conn in (PagedConnector(None, ConnectorContext(SPEC, kv_layout="flashinfer")),
                 PagedConnector({"layout": "flashinfer"}, ConnectorContext(SPEC))):
        conn.from_chunks(spans, kv_caches=flashinfer, block_ids=[1, 0])
        ks, vs = token_kv(flash, "flash", [2, 0], block, total)
        for layer, cache in enumerate(flashinfer):
            for t in range(total):
                b, o = [1, 0][t // block], t % block
                assert torch.equal(cache[b, 0, o], ks[layer][t])
                assert torch.equal(cache[b, 1, o], vs[layer][t])
    assert PagedConnector.spec_from(kv_caches=flashinfer, kv_layout="flashinfer") == SPEC


def test_the_layout_option_wins_over_the_integration_s() -> None:
    conn = PagedConnector({"layout": "cpu", "kernels": "torch"},
                          ConnectorContext(SPEC, kv_layout="flash"))
    assert conn.layout == "cpu" and conn.kernels == "torch"
    assert PagedConnector(None, ConnectorContext(SPEC)).layout is None


@pytest.mark.parametrize("rank", [3, 4])
def test_mla_caches_are_one_latent_per_token(rank: int) -> None:
    """MLA: ``[num_blocks, block_size, latent]`` (or vLLM's ``[B, 1, N, latent]``,
    named), chunks ``[layers, 1, tokens, 1, latent]``."""
    latent, block, total = 24, 16, 40
    caches = [torch.randn(5, block, latent) for _ in range(L)]
    named = "mla" if rank == 4 else None
    if rank == 4:
        caches = [c[:, None] for c in caches]
    spec = PagedConnector.spec_from(kv_caches=caches, kv_layout=named)
    assert spec == KVSpec(L, 1, latent, torch.float32, kv_planes=1)
    assert spec.chunk_shape(7) == (L, 1, 7, 1, latent) and spec.chunk_layout == "l1thd"
    conn = PagedConnector(None, ConnectorContext(spec, kv_layout=named))
    spans = [ChunkSpan(s, min(s + 16, total), torch.empty(spec.chunk_shape(min(16, total - s))))
             for s in range(0, total, 16)]
    ids = [4, 1, 3]
    conn.to_chunks(spans, kv_caches=caches, block_ids=ids)
    flat = [c.view(5, block, latent) for c in caches]
    for span in spans:
        for layer in range(L):
            for t in range(span.start, span.end):
                assert torch.equal(span.buffer[layer, 0, t - span.start, 0],
                                   flat[layer][ids[t // block], t % block])
    out = [torch.zeros_like(c) for c in caches]
    conn.from_chunks(spans, kv_caches=out, block_ids=ids)
    for a, b in zip(out, caches, strict=True):
        rows = [ids[t // block] * block + t % block for t in range(total)]
        assert torch.equal(a.reshape(-1, latent)[rows], b.reshape(-1, latent)[rows])
        assert int((a != 0).any(-1).sum()) == total  # and nothing else
    with pytest.raises(ValueError, match=r"1 vector.*this engine's KV holds 2"):
        PagedConnector(None, ConnectorContext(KVSpec(L, 1, latent, torch.float32),
                                              kv_layout="mla")).to_chunks(
            spans, kv_caches=caches, block_ids=ids)
