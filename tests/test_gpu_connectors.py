from __future__ import annotations

import pytest
import torch

from lmkv.gpu import ChunkSpan, KVSpec
from lmkv_backends.gpu_torch import HFConnector, PagedConnector

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
    conn = HFConnector(None, SPEC)
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
    conn = PagedConnector(PagedConnector.Options(layout=layout), SPEC)
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
    PagedConnector(PagedConnector.Options(layout="flash"), SPEC).to_chunks(
        spans, kv_caches=flash, block_ids=[2, 0, 1])
    cpu = [torch.zeros(4, H, block, 2 * D) for _ in range(L)]
    PagedConnector(PagedConnector.Options(layout="cpu"), SPEC).from_chunks(
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
    conn = PagedConnector(PagedConnector.Options(layout=layout), SPEC)
    conn.to_chunks(spans, kv_caches=src, block_ids=block_ids)
    dst = [torch.zeros_like(c) for c in src]
    conn.from_chunks(spans, kv_caches=dst, block_ids=block_ids, skip_tokens=skip)
    ks, vs = token_kv(src, layout, block_ids, block, total)
    ks2, vs2 = token_kv(dst, layout, block_ids, block, total)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert torch.all(b[:skip] == 0)
        assert torch.equal(a[skip:], b[skip:])
