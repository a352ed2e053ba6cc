"""The ``fs`` tier on local disk against ``dd`` on the same filesystem, in the same run.

* durable write: ``batched_submit_put`` of N 32 MiB chunks until its future
  resolves (every entry fdatasync'ed and renamed, the directory fsync'ed)
  against ``dd if=/dev/zero bs=1M oflag=direct conv=fsync`` of the same bytes;
* cold read: the page cache dropped, then ``batched_get_non_blocking`` of the
  N entries into arena buffers (a fresh tier, so its index comes from the
  directory) against ``dd bs=1M iflag=direct`` of the dd file.

Targets: write >= 0.9 of dd, cold read >= 1.0 of dd. Run as root to drop the
page cache through /proc/sys/vm/drop_caches; otherwise each file gets
``posix_fadvise(POSIX_FADV_DONTNEED)`` (the output says which).

    .venv/bin/python benchmarks/bench_fs.py [--dir /var/tmp] [--chunks 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmkv.backend import BackendContext
from lmkv.memory import MemoryAllocator, MemoryObj
from lmkv.tokens import CacheKey, KeyMeta
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers.fs import FSBackend
from lmkv_policies.lru import LRUPolicy

SHAPE = (32, 2, 256, 8, 128)  # Llama-3-8B KV of 256 tokens: 32 layers, K and V, 8 heads
DTYPE = torch.bfloat16
CHUNK_BYTES = 32 << 20
GB = 1e9


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def drop_cache(paths: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def dd(args: str) -> float:
    """Seconds dd reports for its copy."""
    proc = subprocess.run(f"dd {args}", shell=True, check=True, capture_output=True, text=True)
    match = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    if not match:
        raise RuntimeError(f"unexpected dd output: {proc.stderr}")
    return float(match.group(1))


def make_tier(root: Path, arena: MemoryAllocator, io_threads: int | None) -> FSBackend:
    context = BackendContext(serializer=NaiveSerializer(), eviction_policy=LRUPolicy(),
                             allocate=arena.allocate)
    return FSBackend(FSBackend.Options(url=str(root), io_threads=io_threads), context)


def one_round(work: Path, chunks: list[MemoryObj], keys: list[CacheKey],
              read_arena: MemoryAllocator, io_threads: int | None) -> dict[str, float | str]:
    n = len(chunks)
    dd_file = work / "dd.bin"
    entries = work / "entries"
    shutil.rmtree(entries, ignore_errors=True)
    dd_file.unlink(missing_ok=True)
    os.sync()

    dd_write = n * CHUNK_BYTES / dd(f"if=/dev/zero of={dd_file} bs=1M count={n * 32} "
                                    "oflag=direct conv=fsync")
    tier = make_tier(entries, read_arena, io_threads)
    start = time.perf_counter()
    stored = tier.batched_submit_put(keys, chunks).result()
    write_s = time.perf_counter() - start
    written = tier.stats()["bytes_in"]
    tier.close()
    assert stored == n, f"stored {stored} of {n}"

    files = [dd_file, *entries.iterdir()]
    method = drop_cache(files)
    dd_read = n * CHUNK_BYTES / dd(f"if={dd_file} of=/dev/null bs=1M iflag=direct")
    drop_cache(files)
    tier = make_tier(entries, read_arena, io_threads)  # a restart: index from the directory
    start = time.perf_counter()
    got = tier.batched_get_non_blocking("bench", keys).result()
    read_s = time.perf_counter() - start
    read_bytes = tier.stats()["bytes_out"]
    try:
        assert len(got) == n and all(torch.equal(a.tensor, b.tensor)
                                     for a, b in zip(got, chunks, strict=True))
    finally:
        for obj in got:
            obj.ref_down()
        tier.close()
    return {"dd_write": dd_write, "write": written / write_s, "dd_read": dd_read,
            "read": read_bytes / read_s, "cache": method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="a directory on the filesystem to measure (not tmpfs)")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=None)
    args = parser.parse_args()

    kind = fs_type(args.dir.resolve())
    if kind in ("tmpfs", "ramfs"):
        sys.exit(f"{args.dir} is on {kind}: pick a directory on a disk")
    work = Path(tempfile.mkdtemp(prefix="lmkv-bench-fs-", dir=args.dir))
    n = args.chunks
    src_arena = MemoryAllocator(n * CHUNK_BYTES + (1 << 20), pin_memory=False)
    read_arena = MemoryAllocator(n * CHUNK_BYTES + (1 << 20), pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for _ in range(n):
        obj = src_arena.allocate(SHAPE, DTYPE)
        obj.tensor.copy_(torch.randn(SHAPE, generator=gen, dtype=torch.float32))
        chunks.append(obj)
    meta = KeyMeta("meta-llama/Meta-Llama-3-8B", 1, 0, "bfloat16", "l2thd")
    keys = [CacheKey(meta, i.to_bytes(32, "little")) for i in range(n)]

    print(f"fs tier vs dd on {work} ({kind}): {n} chunks of 32 MiB {tuple(SHAPE)} bf16, "
          f"{args.rounds} rounds")
    rows = []
    try:
        for r in range(args.rounds):
            row = one_round(work, chunks, keys, read_arena, args.io_threads)
            rows.append(row)
            print(f"  round {r + 1}: write {row['write'] / GB:.2f} GB/s "
                  f"(dd {row['dd_write'] / GB:.2f}, {row['write'] / row['dd_write']:.2f}x)   "
                  f"cold read {row['read'] / GB:.2f} GB/s "
                  f"(dd {row['dd_read'] / GB:.2f}, {row['read'] / row['dd_read']:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"page cache dropped with: {rows[0]['cache']}; load average {os.getloadavg()[0]:.1f}")
    for what, mine, base, target in (
            ("durable write / dd oflag=direct conv=fsync", "write", "dd_write", 0.9),
            ("cold read / dd iflag=direct", "read", "dd_read", 1.0)):
        median = statistics.median(r[mine] / r[base] for r in rows)
        best = max(r[mine] for r in rows) / max(r[base] for r in rows)
        print(f"{what:44s} median ratio {median:.2f}, best/best {best:.2f}  "
              f"(target >= {target:.2f})")


if __name__ == "__main__":
    main()
