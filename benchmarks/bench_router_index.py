"""The router index's routing decision: match an 8k-token prompt against 10k
indexed prompts (target: under 1 ms), against hashing the prompt alone.

The index holds 10,000 prompts of 8,192 tokens spread over 8 instances (each
prompt's blocks in one instance's engine cache, and for half of them in
another instance's lmkv tiers too); every prompt shares one of 100 system
prompts of 1,024 tokens, so blocks are shared as in real traffic. A decision
is ``block_keys`` of the prompt (the router hashes each request) plus
``match``; both are timed, median and p99 of 1,000 decisions, and the index's
size is printed.

    python benchmarks/bench_router_index.py                # about a minute
    python benchmarks/bench_router_index.py --block-size 128 --prompts 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

import numpy as np

from lmkv.router.index import KVIndex, block_keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decisions", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 50_000, 1024, dtype=np.uint32) for _ in range(100)]
    tracemalloc.start()
    index = KVIndex(max_blocks=1 << 24)
    prompts = []
    start = time.perf_counter()
    for p in range(args.prompts):
        tokens = np.concatenate([systems[p % 100],
                                 rng.integers(0, 50_000, args.tokens - 1024, dtype=np.uint32)])
        prompts.append(tokens)
        n = args.tokens // args.block_size
        names = [(p, i) for i in range(n)]
        index.stored(f"i{p % 8}", names, tokens, args.block_size)
        if p % 2:
            index.stored(f"i{(p + 3) % 8}", names, tokens, args.block_size, medium="lmkv:cpu")
    built = time.perf_counter() - start
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    hash_t, match_t = [], []
    picks = random.Random(1)
    for _ in range(args.decisions):
        tokens = prompts[picks.randrange(len(prompts))]
        t0 = time.perf_counter()
        keys = block_keys(tokens, args.block_size)
        t1 = time.perf_counter()
        found = index.match(keys)
        t2 = time.perf_counter()
        assert found, "an indexed prompt must match"
        hash_t.append(t1 - t0)
        match_t.append(t2 - t1)

    def ms(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3

    total = [a + b for a, b in zip(hash_t, match_t, strict=True)]
    print(f"router index: {args.prompts} prompts of {args.tokens} tokens, blocks of "
          f"{args.block_size} ({len(index)} blocks indexed, {size / 2**20:.0f} MiB, built in "
          f"{built:.1f} s)")
    print(f"  hash the prompt  p50 {ms(hash_t, .5):.3f} ms  p99 {ms(hash_t, .99):.3f} ms")
    print(f"  match            p50 {ms(match_t, .5):.3f} ms  p99 {ms(match_t, .99):.3f} ms")
    print(f"  decision         p50 {ms(total, .5):.3f} ms  p99 {ms(total, .99):.3f} ms  "
          f"(target < 1 ms; mean {statistics.fmean(total) * 1e3:.3f})")


if __name__ == "__main__":
    main()
