"""Chunk order for vLLM's CPU caches: the paged connector's load and store with
chunks in the canonical order (``l2thd``, ``[layers, 2, tokens, heads, dim]``)
against chunks held heads outer (``lht2d``, ``[layers, heads, tokens, 2,
dim]``: ``KVSpec.heads_outer``, what ``PagedConnector.spec_from`` gives cpu
caches), each next to a memcpy of the same bytes.

``bench_warm_path.py``'s model (8 layers, 4 KV heads of 64, float32),
256-token chunks, cpu-layout caches ``[blocks, heads, block, 2 * dim]``, for
512, 2048 and 4096 tokens, a block table of consecutive ids and a shuffled
one. Every sample starts with the CPU's caches holding other data (96 MiB
written first), as a request finds them; the three are interleaved round by
round and the best of ``--rounds`` is kept. x memcpy: time / memcpy time
(lower is better).

    python benchmarks/bench_chunk_order.py --threads 2
    python benchmarks/bench_chunk_order.py --threads 2 --block 16
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from lmkv.contracts.connector import ChunkSpan, ConnectorContext, KVSpec
from lmkv_backends.connectors.paged import PagedConnector

LAYERS, HEADS, DIM, CHUNK = 8, 4, 64, 256
DTYPE = torch.float32
CANONICAL = KVSpec(LAYERS, HEADS, DIM, DTYPE)
_SCRATCH = torch.zeros(96 << 20, dtype=torch.uint8)


def cold() -> None:
    _SCRATCH.add_(1)


def best(fns: list[Callable[[], None]], rounds: int) -> list[float]:
    times = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            cold()
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


def bench(tokens: int, block: int, rounds: int) -> None:
    blocks = -(-tokens // block)
    caches = [torch.randn(2 * blocks, HEADS, block, 2 * DIM, dtype=DTYPE) for _ in range(LAYERS)]
    outer = PagedConnector.spec_from(kv_caches=caches)
    assert outer == replace(CANONICAL, heads_outer=True)
    nbytes = CANONICAL.chunk_nbytes(tokens)
    src, dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)
    tables = {"consecutive": list(range(blocks, 2 * blocks)),
              "shuffled": random.Random(0).sample(range(2 * blocks), blocks)}
    print(f"\n[{tokens} tokens, {nbytes / (1 << 20):.0f} MiB, {block}-token blocks] "
          "ms (x memcpy)")
    conns = [PagedConnector(None, ConnectorContext(spec)) for spec in (CANONICAL, outer)]
    spans = [[ChunkSpan(s, min(s + CHUNK, tokens),
                        torch.zeros(spec.chunk_shape(min(CHUNK, tokens - s)), dtype=DTYPE))
              for s in range(0, tokens, CHUNK)] for spec in (CANONICAL, outer)]
    for name, table in tables.items():
        fns: list[Callable[[], None]] = [lambda: dst.copy_(src)]
        for conn, sp in zip(conns, spans, strict=True):
            fns.append(lambda c=conn, sp=sp, t=table: c.to_chunks(sp, kv_caches=caches,
                                                                  block_ids=t))
            fns.append(lambda c=conn, sp=sp, t=table: c.from_chunks(sp, kv_caches=caches,
                                                                    block_ids=t))
        memcpy, *copies = best(fns, rounds)
        row = [f"{spec.chunk_layout}: store {store * 1e3:6.2f} ({store / memcpy:.2f}) "
               f"load {load * 1e3:6.2f} ({load / memcpy:.2f})"
               for spec, store, load in zip((CANONICAL, outer), copies[::2], copies[1::2],
                                            strict=True)]
        print(f"  {name:11s} memcpy {memcpy * 1e3:5.2f}  " + "  ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=128, help="tokens per block")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for tokens in (512, 2048, 4096):
        bench(tokens, args.block, args.rounds)


if __name__ == "__main__":
    main()
