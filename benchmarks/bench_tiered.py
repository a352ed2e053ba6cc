"""Tiered retrieve: a 32k-token prefix split across the cpu and fs tiers.

The first half of the prefix's chunks sits in the cpu tier, the second half
only on disk (fs tier). The tiered retrieve is timed against the sum of the
two single-tier retrieves of the same halves, in the same run. All gets start
at once and the cpu half is copied into the paged cache while the disk half
is still being read, so the tiered time should come out below the sum.

    python benchmarks/bench_tiered.py [--dir /var/tmp] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import torch

from lmkv import KVSpec, StorageManager, load_config
from lmkv.contracts.connector import ChunkSpan
from lmkv.engines.local import LocalEngine  # a second engine over the cpu tier alone
from lmkv.memory import release
from lmkv.testing.engines import open_local_engine

CHUNK, CHUNKS, BLOCK = 256, 128, 128
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)  # 1 MiB a chunk


def drop_page_cache() -> str:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "none (not root): reads may come from the page cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp", help="directory on the disk to test")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="lmkv-tiered-", dir=args.dir)
    config = load_config(env={}, overrides={
        "lmkv.gpu_connector": "paged",
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "512MiB"}},
                       {"type": "fs", "options": {"url": root, "max_bytes": "1GiB"}}]})
    engine = open_local_engine(config, SPEC, model_name="bench", kv_kind="paged")
    storage, connector = engine.storage, engine.connector
    cpu, fs = storage.tiers

    tokens = list(range(CHUNKS * CHUNK))
    blocks = CHUNKS * CHUNK // BLOCK
    src = [torch.randn(blocks, 4, BLOCK, 128).to(torch.bfloat16) for _ in range(4)]
    dst = [torch.zeros_like(c) for c in src]
    table = list(range(blocks))
    engine.store(tokens, kv_caches=src, block_ids=table)
    assert storage.flush(120), "fs writes did not finish"
    chunks = engine.chunker.chunk(tokens)
    half = CHUNKS // 2
    cpu_only = LocalEngine(config, SPEC, model_name="bench", connector=connector,
                           storage=StorageManager([cpu]))
    fs_only = StorageManager([fs])

    def evict_second_half() -> None:
        for key in chunks.keys[half:]:
            cpu.remove(key)

    def time_cpu_half() -> float:
        t0 = time.perf_counter()
        result = cpu_only.retrieve(tokens[:half * CHUNK], kv_caches=dst, block_ids=table)
        assert result.num_tokens == half * CHUNK
        return time.perf_counter() - t0

    def time_fs_half() -> float:
        drop_page_cache()
        t0 = time.perf_counter()
        n = 0
        for first, objs in fs_only.stream(chunks.keys[half:]):
            spans = [ChunkSpan(chunks.starts[half + first + i], chunks.ends[half + first + i],
                               o.tensor) for i, o in enumerate(objs)]
            connector.from_chunks(spans, kv_caches=dst, block_ids=table)
            release(objs)
            n += len(objs)
        assert n == half, n
        return time.perf_counter() - t0

    def time_tiered() -> float:
        evict_second_half()
        drop_page_cache()
        t0 = time.perf_counter()
        result = engine.retrieve(tokens, kv_caches=dst, block_ids=table)
        elapsed = time.perf_counter() - t0
        assert result.num_tokens == CHUNKS * CHUNK
        return elapsed

    evict_second_half()
    cache_note = drop_page_cache()
    rows = {"cpu": [], "fs": [], "tiered": []}
    for _ in range(args.rounds):  # interleaved, so load changes hit all three alike
        rows["cpu"].append(time_cpu_half())
        rows["fs"].append(time_fs_half())
        rows["tiered"].append(time_tiered())
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    med = {k: statistics.median(v) for k, v in rows.items()}
    total = med["cpu"] + med["fs"]
    mib = CHUNKS * SPEC.chunk_nbytes(CHUNK) / 2**20
    print(f"32k-token prefix ({CHUNKS} chunks, {mib:.0f} MiB), half in cpu, half on disk "
          f"({args.dir}); page cache dropped: {cache_note}")
    print(f"  cpu half alone    : {med['cpu'] * 1e3:8.1f} ms")
    print(f"  fs half alone     : {med['fs'] * 1e3:8.1f} ms")
    print(f"  sum               : {total * 1e3:8.1f} ms")
    print(f"  tiered, both      : {med['tiered'] * 1e3:8.1f} ms  ratio to the sum "
          f"{med['tiered'] / total:.2f}")
    engine.close()
    subprocess.run(["rm", "-rf", root], check=False)
    os.sync()


if __name__ == "__main__":
    main()
