"""Paged connector: copies between vLLM-style paged caches and chunk buffers.

``PagedConnector.to_chunks`` (store) and ``from_chunks`` (load), which run the
``lmkv_kernels`` copies (``gather_blocks``/``scatter_blocks``), for 512, 2048
and 4096 tokens of a small model (8 layers, 4 KV heads, head size 64, bf16:
8 KiB a token), 256-token chunks, 128-token blocks (``--block``), in both cache
layouts, with a block table of consecutive ids and one of shuffled ids. Each
figure is printed next to a ``torch`` ``copy_`` of the same number of
contiguous bytes (from the chunk buffers' memory to the caches') measured in
the same run (ratio = memcpy time / connector time, higher is better), next
to the same bytes copied contiguously in one copy per chunk and layer (about
the most any connector can hope for, as the caches are one tensor per layer),
and next to the connector's previous implementation (two small strided copies
per block and layer), kept in this file as "before".

    python benchmarks/bench_paged.py            # one torch thread (the fair baseline)
    python benchmarks/bench_paged.py --threads 2 --rounds 60 --block 16
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence

import torch
from _timing import best_of

from lmkv.contracts.connector import ChunkSpan, ConnectorContext, KVSpec
from lmkv_backends.connectors.paged import PagedConnector
from lmkv_kernels import geometry

SPEC = KVSpec(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
CHUNK = 256


def make_pool(layout: str, num_blocks: int, block: int) -> torch.Tensor:
    """All layers' caches in one tensor: ``list(pool)`` is the connector's ``kv_caches``."""
    h, d = SPEC.num_kv_heads, SPEC.head_dim
    shape = (2, num_blocks, block, h, d) if layout == "flash" else (num_blocks, h, block, 2 * d)
    return torch.randn(SPEC.num_layers, *shape).to(SPEC.dtype)


# -- the previous implementation, for comparison only ------------------------------------------

def _runs_before(span: ChunkSpan, block_ids: Sequence[int], block_size: int):
    runs, t = [], span.start
    while t < span.end:
        offset = t % block_size
        n = min(block_size - offset, span.end - t)
        runs.append((int(block_ids[t // block_size]), offset, offset + n,
                     t - span.start, t - span.start + n))
        t += n
    return runs


def to_chunks_before(conn: PagedConnector, spans: Sequence[ChunkSpan],
                     kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    g = geometry(kv_caches[0])
    block_size, flash, d = g.block_size, g.layout == "flash", SPEC.head_dim
    for span in spans:
        runs, buf = _runs_before(span, block_ids, block_size), span.buffer
        for layer, cache in enumerate(kv_caches):
            for block, o0, o1, t0, t1 in runs:
                if flash:
                    buf[layer, :, t0:t1].copy_(cache[:, block, o0:o1])
                else:
                    part = cache[block, :, o0:o1].transpose(0, 1)
                    buf[layer, 0, t0:t1].copy_(part[..., :d])
                    buf[layer, 1, t0:t1].copy_(part[..., d:])


def from_chunks_before(conn: PagedConnector, spans: Sequence[ChunkSpan],
                       kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    g = geometry(kv_caches[0])
    block_size, flash, d = g.block_size, g.layout == "flash", SPEC.head_dim
    for span in spans:
        runs = _runs_before(span, block_ids, block_size)
        for layer, cache in enumerate(kv_caches):
            src = span.buffer[layer]
            for block, o0, o1, t0, t1 in runs:
                if flash:
                    cache[:, block, o0:o1].copy_(src[:, t0:t1])
                else:
                    part = cache[block, :, o0:o1]
                    part[..., :d].copy_(src[0, t0:t1].transpose(0, 1))
                    part[..., d:].copy_(src[1, t0:t1].transpose(0, 1))


# ----------------------------------------------------------------------------------------------

def fastest(fns: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """The fastest time of each of ``fns``. They take turns, so that load from other
    jobs hits them alike, and each timed call follows an untimed one of the same
    function (warm caches, as for a single ``best_of``)."""
    times = [[best_of(fn, 1) for fn in fns] for _ in range(rounds)]
    return [min(column) for column in zip(*times, strict=True)]


def bench(layout: str, tokens: int, block: int, rounds: int) -> None:
    blocks = -(-tokens // block)
    pool = make_pool(layout, 2 * blocks, block)  # room for a table spread over the cache
    caches = list(pool)
    nbytes = SPEC.chunk_nbytes(tokens)
    arena = torch.empty(nbytes, dtype=torch.uint8)  # chunk buffers are slots of one arena
    slot = SPEC.chunk_nbytes(CHUNK)
    spans = [ChunkSpan(s, s + CHUNK, arena[s // CHUNK * slot:][:slot].view(SPEC.dtype)
                       .view(SPEC.chunk_shape(CHUNK))) for s in range(0, tokens, CHUNK)]
    pool_bytes = pool.view(-1).view(torch.uint8)  # the memcpy writes where loads do
    layer_size = SPEC.chunk_nbytes(CHUNK) // SPEC.num_layers // SPEC.dtype.itemsize

    def layer_copies() -> None:  # the same bytes in one contiguous copy per chunk and layer
        for i, span in enumerate(spans):
            for layer, cache in enumerate(caches):
                cache.view(-1)[i * layer_size:][:layer_size].copy_(span.buffer[layer].view(-1))

    tables = {"consecutive": list(range(3, 3 + blocks)),
              "shuffled": random.Random(0).sample(range(2 * blocks), blocks)}
    conn = PagedConnector(None, ConnectorContext(SPEC))
    print(f"\n[{layout} layout, {tokens} tokens, {nbytes / (1 << 20):.0f} MiB, "
          f"{block}-token blocks] ms (memcpy time / time)")
    for table_name, t in tables.items():
        to_chunks_before(conn, spans, caches, t)  # before and after store the same bytes
        stored = arena.clone()
        conn.to_chunks(spans, kv_caches=caches, block_ids=t)
        assert torch.equal(arena, stored), "to_chunks differs from the previous implementation"
        memcpy, per_layer, *figures = fastest([
            lambda: pool_bytes[:nbytes].copy_(arena),
            layer_copies,
            lambda t=t: to_chunks_before(conn, spans, caches, t),
            lambda t=t: conn.to_chunks(spans, kv_caches=caches, block_ids=t),
            lambda t=t: from_chunks_before(conn, spans, caches, t),
            lambda t=t: conn.from_chunks(spans, kv_caches=caches, block_ids=t),
        ], rounds)
        print(f"  {table_name} block table: memcpy {memcpy * 1e3:.2f}, one contiguous copy "
              f"per chunk and layer {per_layer * 1e3:.2f} ({memcpy / per_layer:.2f})")
        for name, before, after in (("to_chunks", *figures[:2]), ("from_chunks", *figures[2:])):
            print(f"    {name:11s}: before {before * 1e3:6.2f} ({memcpy / before:.2f})  "
                  f"after {after * 1e3:6.2f} ({memcpy / after:.2f})  "
                  f"{before / after:.1f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=128, help="tokens per block")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (torch splits copies of 32 Ki elements and more)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for layout in ("cpu", "flash"):
        for tokens in (512, 2048, 4096):
            bench(layout, tokens, args.block, args.rounds)


if __name__ == "__main__":
    main()
