"""Eviction-heavy cpu tier: a workload ten times the budget, chunks/s per policy.

Prompts of 16 small chunks (8 KiB, so the policy's bookkeeping is not hidden
behind copies), half of them extending a random prefix of an earlier prompt:
each request reads the prefix the tier still holds (refreshing it), then
allocates and stores the rest, with parents, evicting as it goes. The chunks
stored add up to ten times the tier's budget. Printed: chunks stored per
CPU second of this process (the machine is shared: CPU time does not count
the waits for a core) for every eviction policy this tree registers (best of
``--rounds``), and the share of chunks asked that hit (the same requests for every policy).

Runs on older trees too (a tier whose put takes no parents gets none), so
``benchmarks/before_after.py --base REV benchmarks/bench_eviction.py``
compares each policy with what that revision had (``lru``).

    python benchmarks/bench_eviction.py [--rounds 3] [--chunks 2048]
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

import torch

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.contracts.policy import EvictionContext
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta

SHAPE = (2, 2, 16, 2, 32)
DTYPE = torch.float16
CHUNK_BYTES = 2 * 2 * 16 * 2 * 32 * 2
PROMPT_CHUNKS = 16


def make_tier(policy: str, chunks: int):
    try:
        config = load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "cpu", "options": {"max_bytes": chunks * CHUNK_BYTES},
             "eviction": policy}]})
    except ConfigError:
        return None  # not in this tree
    (tier,) = config.plugins.tiers
    return tier.backend.create(BackendContext(eviction_policy=tier.eviction.create(
        EvictionContext())))


def requests(budget_chunks: int, seed: int = 0) -> list[list[int]]:
    """Prompts (chunk ids) whose new chunks add up to ten budgets at least."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_id = new = 0
    while new < 10 * budget_chunks:
        if prompts and rng.random() < 0.5:
            base = rng.choice(prompts[-200:])
            head = base[:rng.randint(1, len(base) - 1)]
        else:
            head = []
        tail = list(range(next_id, next_id + PROMPT_CHUNKS - len(head)))
        next_id += len(tail)
        new += len(tail)
        prompts.append(head + tail)
    return prompts


def run(tier, prompts: list[list[int]], keys: list[CacheKey], with_parents: bool
        ) -> tuple[float, int, int, int]:
    """CPU seconds of this process, chunks stored, chunks hit, chunks requested."""
    stored = hits = asked = 0
    start = time.process_time()
    for prompt in prompts:
        ks = [keys[i] for i in prompt]
        got = tier.batched_get_non_blocking("bench", ks).result()
        h = len(got)
        objs = []
        for _ in range(h, len(ks)):
            obj = tier.allocate(SHAPE, DTYPE)
            if obj is None:
                break
            objs.append(obj)
        new = ks[h:h + len(objs)]
        if with_parents:
            parents = [ks[h - 1] if h else None, *new[:-1]]
            tier.batched_submit_put(new, objs, parents).result()
        else:
            tier.batched_submit_put(new, objs).result()
        for obj in [*got, *objs]:
            obj.ref_down()
        stored += len(objs)
        hits += h
        asked += len(ks)
    return time.process_time() - start, stored, hits, asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=2048, help="the tier's budget, in chunks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = requests(args.chunks)
    meta = KeyMeta("bench-eviction")
    keys = [CacheKey(meta, i.to_bytes(32, "little"))
            for i in range(max(max(p) for p in prompts) + 1)]
    print(f"[eviction] cpu tier of {args.chunks} chunks ({CHUNK_BYTES // 1024} KiB each), "
          f"{len(prompts)} prompts of {PROMPT_CHUNKS} chunks: ten budgets stored")
    for policy in ("lru", "lfu", "arc", "s3fifo"):
        best = None
        for _ in range(args.rounds):
            tier = make_tier(policy, args.chunks)
            if tier is None:
                break
            with_parents = "parents" in inspect.signature(tier.batched_submit_put).parameters
            result = run(tier, prompts, keys, with_parents)
            tier.close()
            best = result if best is None or result[0] < best[0] else best
        if best is None:
            continue
        seconds, stored, hits, asked = best
        print(f"  {policy}: {stored / seconds:9.0f} chunks/s  (hits {100 * hits / asked:.1f}% "
              f"of the chunks asked; {stored} stored)")


if __name__ == "__main__":
    main()
