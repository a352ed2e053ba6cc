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

``--cross-process`` measures what a fresh second engine process pays to read
what a first one stored, against vLLM's ``ExampleConnector`` format (one
safetensors file per layer, written without fsync, read with
``safetensors.torch.load_file``) in the same run. The chunks are
``bench_vllm.py``'s (8 layers, 4 KV heads, head size 64, float32, 256 tokens: 4
MiB each; 16 chunks = 4096 tokens). A writer process stores them through an fs
tier (durable, the tier's ``page_cache`` setting) and writes the safetensors
files; a fresh reader process opens the tier (its index comes from the
directory), reads the chunks into a fresh arena and copies them into one
destination tensor (as a connector copies into the paged cache), then loads the
safetensors files and copies them the same way. A third fresh process reads the
chunks directly (``direct``: the fs tier's ``direct_reads``, piece by piece
through one staging buffer into the destination, as an engine whose KV is in
host memory does; ``dir/st`` against the safetensors files). ``--touched-arena`` touches the
reader's arena before timing (as a page-locked arena on a GPU host, or one that
served earlier reads, is): the difference is the first-touch cost of fresh
memory. Settings:

* ``page_cache: true``: the writer leaves the entries' pages in the page cache;
* ``page_cache: false``: it hands them back after the fdatasync (the reader
  reads from the disk, the safetensors files come from the page cache);
* ``cold``: the page cache is dropped for both after the writer (root only:
  ``/proc/sys/vm/drop_caches``; otherwise ``POSIX_FADV_DONTNEED`` per file).

    .venv/bin/python benchmarks/bench_fs.py [--dir /var/tmp] [--chunks 16] [--rounds 3]
    .venv/bin/python benchmarks/bench_fs.py [--page-cache true|false]
    .venv/bin/python benchmarks/bench_fs.py --cross-process [--rounds 5] [--touched-arena]
    .venv/bin/python benchmarks/bench_fs.py --write-cpu [--rounds 5]

``--write-cpu`` measures the CPU time (every thread of the process, user and
system) that storing ``bench_vllm.py``'s 4 MiB chunks costs, durable and not:
the fs tier as it is (``WRITE_SEGMENT`` bytes per ``pwritev``), the same tier
writing each entry in one call (what it did before), and, as the baseline, a
plain ``pwrite`` of the same bytes into new files in 1 MiB pieces, without
fsync. On kernels that cache files in large folios, a write of several MiB in
one call can cost many times the CPU of the same bytes in pieces; every
figure is a ratio against the baseline of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from lmkv.contracts.direct_chunk import PIECE_BYTES, DirectChunk
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, MemoryObj
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers import fs_local
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


def make_tier(root: Path, arena: MemoryAllocator, io_threads: int | None,
              page_cache: bool = False, mapped_reads: bool = True) -> FSBackend:
    context = BackendContext(serializer=NaiveSerializer(), eviction_policy=LRUPolicy(),
                             allocate=arena.allocate)
    # durable: what this script times is the write that completes on the disk
    return FSBackend(FSBackend.Options(url=str(root), io_threads=io_threads, durable=True,
                                       page_cache=page_cache, mapped_reads=mapped_reads),
                     context)


def one_round(work: Path, chunks: list[MemoryObj], keys: list[CacheKey],
              read_arena: MemoryAllocator, io_threads: int | None,
              page_cache: bool) -> dict[str, float | str]:
    n = len(chunks)
    dd_file = work / "dd.bin"
    entries = work / "entries"
    shutil.rmtree(entries, ignore_errors=True)
    dd_file.unlink(missing_ok=True)
    os.sync()

    dd_write = n * CHUNK_BYTES / dd(f"if=/dev/zero of={dd_file} bs=1M count={n * 32} "
                                    "oflag=direct conv=fsync")
    tier = make_tier(entries, read_arena, io_threads, page_cache)
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
    tier = make_tier(entries, read_arena, io_threads, page_cache)  # a restart
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


# -- CPU time of writes ------------------------------------------------------------------
def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_cpu_main(args: argparse.Namespace) -> None:
    """CPU seconds per stored chunk: the tier's write path against plain pwrites."""
    n = args.chunks
    full, keys = vllm_chunks(n)
    chunk_bytes = _chunk(full, 0).numel() * full.element_size()
    arena = MemoryAllocator(n * chunk_bytes + (1 << 20), pin_memory=False)
    chunks = []
    for i in range(n):
        obj = arena.allocate(VLLM_SHAPE, VLLM_DTYPE)
        obj.tensor.copy_(_chunk(full, i))
        chunks.append(obj)
    work = Path(tempfile.mkdtemp(prefix="lmkv-bench-fs-", dir=args.dir))
    payload = [memoryview(obj.byte_view().numpy()) for obj in chunks]

    def plain(root: Path) -> None:
        root.mkdir()
        for i, view in enumerate(payload):
            fd = os.open(root / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for off in range(0, view.nbytes, 1 << 20):
                    os.pwrite(fd, view[off:off + (1 << 20)], off)
            finally:
                os.close(fd)

    def tier(root: Path, durable: bool, segment: int) -> None:
        saved = fs_local.WRITE_SEGMENT
        fs_local.WRITE_SEGMENT = segment
        try:
            backend = FSBackend(FSBackend.Options(url=str(root), durable=durable,
                                                  page_cache=True),
                                BackendContext(serializer=NaiveSerializer(),
                                               eviction_policy=LRUPolicy()))
            try:
                assert backend.batched_submit_put(keys, chunks).result() == n
            finally:
                backend.close()
        finally:
            fs_local.WRITE_SEGMENT = saved

    cases = {"plain pwrite, 1 MiB pieces (baseline)": plain}
    for durable in (False, True):
        name = "durable" if durable else "not durable"
        cases[f"fs tier, {name}, {fs_local.WRITE_SEGMENT >> 10} KiB pieces"] = partial(
            tier, durable=durable, segment=fs_local.WRITE_SEGMENT)
        cases[f"fs tier, {name}, one call per entry"] = partial(
            tier, durable=durable, segment=1 << 40)
    samples: dict[str, list[float]] = {label: [] for label in cases}
    try:
        for r in range(args.rounds):
            for label, run in cases.items():  # interleaved: drift hits every case alike
                root = work / f"{r}-{len(samples[label])}-{abs(hash(label))}"
                before = _cpu_s()
                run(root)
                samples[label].append((_cpu_s() - before) / n)
                # (kept until the end: pages freed here would be the next case's
                # new pages, which a long-running engine's writes rarely find)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"CPU time per stored chunk of {chunk_bytes / (1 << 20):.0f} MiB on {args.dir} "
          f"({fs_type(args.dir.resolve())}), kernel {os.uname().release}; "
          f"median of {args.rounds}")
    base = statistics.median(samples["plain pwrite, 1 MiB pieces (baseline)"])
    for label, got in samples.items():
        med = statistics.median(got)
        print(f"  {label:<44} {med * 1e3:7.2f} ms  x baseline {med / base:5.2f}")


# -- across processes: fs tier vs ExampleConnector's safetensors files ---------------------
VLLM_LAYERS, VLLM_CHUNK = 8, 256
VLLM_SHAPE = (VLLM_LAYERS, 2, VLLM_CHUNK, 4, 64)  # bench_vllm.py's model, one chunk
VLLM_DTYPE = torch.float32
SETTINGS = ("page_cache: true", "page_cache: false", "cold")


def vllm_chunks(n: int) -> tuple[torch.Tensor, list[CacheKey]]:
    """The whole prompt's KV, (layers, 2, n * 256, heads, head size), and its chunk keys."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn((VLLM_LAYERS, 2, n * VLLM_CHUNK, *VLLM_SHAPE[3:]), generator=gen,
                       dtype=VLLM_DTYPE)
    meta = KeyMeta("bench/vllm-llama", 1, 0, "float32", "l2thd")
    return full, [CacheKey(meta, (i + 1).to_bytes(32, "little")) for i in range(n)]


def _chunk(full: torch.Tensor, i: int) -> torch.Tensor:
    return full[:, :, i * VLLM_CHUNK:(i + 1) * VLLM_CHUNK]


def cross_writer(work: Path, n: int, page_cache: bool, touched: bool) -> dict[str, float]:
    """Store the chunks through an fs tier and as ExampleConnector's per-layer files."""
    from safetensors.torch import save_file

    full, keys = vllm_chunks(n)
    arena = MemoryAllocator(n * _chunk(full, 0).nbytes + (1 << 20), pin_memory=False)
    objs = []
    for i in range(n):
        obj = arena.allocate(VLLM_SHAPE, VLLM_DTYPE)
        obj.tensor.copy_(_chunk(full, i))
        objs.append(obj)
    tier = make_tier(work / "entries", arena, None, page_cache)
    start = time.perf_counter()
    stored = tier.batched_submit_put(keys, objs).result()
    fs_s = time.perf_counter() - start
    tier.close()
    assert stored == n, f"stored {stored} of {n}"
    (work / "example").mkdir(exist_ok=True)
    start = time.perf_counter()
    for layer in range(VLLM_LAYERS):
        save_file({"kv_cache": full[layer].contiguous()},
                  str(work / "example" / f"layer{layer}.safetensors"))
    return {"fs_write_ms": fs_s * 1e3, "st_write_ms": (time.perf_counter() - start) * 1e3}


def cross_reader(work: Path, n: int, page_cache: bool, touched: bool) -> dict[str, float]:
    """A fresh process: open the tier, read every chunk, copy it out; then the same
    from the safetensors files. Checks both against the data written."""
    from safetensors.torch import load_file

    full, keys = vllm_chunks(n)
    dst = torch.empty_like(full)
    dst.zero_()  # touched before timing, as a paged cache is
    arena = MemoryAllocator(n * _chunk(full, 0).nbytes + (1 << 20), pin_memory=False)
    out: dict[str, float] = {}
    if touched:  # as a page-locked arena (GPU hosts) or one used before is
        arena.arena.fill_(0)
    start = time.perf_counter()
    tier = make_tier(work / "entries", arena, None, page_cache)
    hits = tier.batched_async_contains("bench", keys)
    out["fs_open_ms"] = (time.perf_counter() - start) * 1e3
    got = tier.batched_get_non_blocking("bench", keys).result()
    out["fs_read_ms"] = (time.perf_counter() - start) * 1e3
    for i, obj in enumerate(got):
        _chunk(dst, i).copy_(obj.tensor)
    out["fs_ms"] = (time.perf_counter() - start) * 1e3
    assert hits == n and len(got) == n and torch.equal(dst, full), "the fs tier read wrong KV"
    for obj in got:
        obj.ref_down()
    tier.close()
    dst.zero_()
    start = time.perf_counter()
    loaded = [load_file(str(work / "example" / f"layer{layer}.safetensors"))["kv_cache"]
              for layer in range(VLLM_LAYERS)]
    out["st_read_ms"] = (time.perf_counter() - start) * 1e3
    for layer, kv in enumerate(loaded):
        dst[layer].copy_(kv)
    out["st_ms"] = (time.perf_counter() - start) * 1e3
    assert torch.equal(dst, full), "the safetensors files read wrong KV"
    return out


def cross_direct_reader(work: Path, n: int, page_cache: bool, touched: bool,
                        mapped: bool = True) -> dict[str, float]:
    """A fresh process: open the tier and read every chunk directly
    (``lmkv.contracts.direct_chunk``: piece by piece, each checksummed and copied
    into the destination as an engine whose KV is in host memory does) through
    the file's guarded mapping, or (``mapped`` false) with pread into one staging
    buffer."""
    full, keys = vllm_chunks(n)
    dst = torch.empty_like(full)
    dst.zero_()
    staging = torch.zeros(PIECE_BYTES, dtype=torch.uint8)  # touched once, as the engine's
    arena = MemoryAllocator(1 << 20, pin_memory=False)  # (direct reads take none)
    out: dict[str, float] = {}
    start = time.perf_counter()
    tier = make_tier(work / "entries", arena, None, page_cache, mapped)
    hits = tier.batched_async_contains("bench", keys)
    future = tier.batched_get_direct("bench", keys)
    assert future is not None, "the fs tier offers no direct reads here"
    got = future.result()
    out["direct_open_ms" if mapped else "pread_open_ms"] = (time.perf_counter() - start) * 1e3
    for i, chunk in enumerate(got):
        assert isinstance(chunk, DirectChunk)
        view = _chunk(dst, i)
        for first, piece in chunk.pieces(staging):
            view[first:first + piece.shape[0]].copy_(piece)
    out["direct_ms" if mapped else "pread_ms"] = (time.perf_counter() - start) * 1e3
    assert hits == n and len(got) == n and torch.equal(dst, full), "direct reads: wrong KV"
    for chunk in got:
        chunk.ref_down()
    tier.close()
    return out


def cross_process_main(args: argparse.Namespace) -> None:
    n = args.chunks
    mib = n * _chunk(vllm_chunks(1)[0], 0).nbytes / (1 << 20)
    print(f"fresh second process: fs tier vs ExampleConnector's safetensors files on "
          f"{args.dir} ({fs_type(args.dir.resolve())}): {n} chunks of {VLLM_SHAPE} float32 "
          f"({n * VLLM_CHUNK} tokens, {mib:.0f} MiB), {args.rounds} rounds"
          + (", reader's arena touched first" if args.touched_arena else ""))
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    method = ""
    base = [sys.executable, __file__, "--chunks", str(n)]
    if args.touched_arena:
        base.append("--touched-arena")
    for round_ in range(args.rounds):
        for setting in SETTINGS:
            work = Path(tempfile.mkdtemp(prefix="lmkv-bench-fs-", dir=args.dir))
            try:
                flag = ["--page-cache", "false" if setting == "page_cache: false" else "true"]
                writer = json.loads(subprocess.run(
                    [*base, "--role", "writer", "--work", str(work), *flag], check=True,
                    capture_output=True, text=True).stdout)
                os.sync()  # nothing dirty left for the reader to wait on
                if setting == "cold":
                    method = drop_cache([*work.joinpath("entries").iterdir(),
                                         *work.joinpath("example").iterdir()])
                reader = json.loads(subprocess.run(
                    [*base, "--role", "reader", "--work", str(work), *flag], check=True,
                    capture_output=True, text=True).stdout)
                direct = {}
                # (in turn first: the first reader after the writer may find the disk busy)
                for role in ("direct", "direct-pread")[::1 if round_ % 2 else -1]:
                    if setting == "cold":  # each direct reader starts cold too
                        drop_cache([*work.joinpath("entries").iterdir()])
                    direct.update(json.loads(subprocess.run(
                        [*base, "--role", role, "--work", str(work), *flag], check=True,
                        capture_output=True, text=True).stdout))
                rows[setting].append({**writer, **reader, **direct})
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(f"{'setting':<19}{'fs open':>9}{'fs read':>9}{'fs +copy':>10}{'direct':>8}{'pread':>8}"
          f"{'st read':>9}{'st +copy':>10}{'fs/st':>7}{'dir/st':>7}{'fs write':>10}"
          f"{'st write':>10}   (medians, ms)")
    for setting, got in rows.items():
        med = {k: statistics.median(r[k] for r in got) for k in got[0]}
        print(f"{setting:<19}{med['fs_open_ms']:>9.1f}{med['fs_read_ms']:>9.1f}"
              f"{med['fs_ms']:>10.1f}{med['direct_ms']:>8.1f}{med['pread_ms']:>8.1f}"
              f"{med['st_read_ms']:>9.1f}"
              f"{med['st_ms']:>10.1f}{med['fs_ms'] / med['st_ms']:>7.2f}"
              f"{med['direct_ms'] / med['st_ms']:>7.2f}{med['fs_write_ms']:>10.1f}"
              f"{med['st_write_ms']:>10.1f}")
    print("fs read = open + lookup + reads into a fresh arena; +copy = then copied into one "
          "destination tensor; direct = open + lookup + direct reads "
          "(lmkv.contracts.direct_chunk) into it through mapped entries (the default), "
          "pread = the same with mapped_reads: false; "
          "fs write is durable (fdatasync), st write is not")
    print(f"cold: page cache dropped with {method}; load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="a directory on the filesystem to measure (not tmpfs)")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=None)
    parser.add_argument("--cross-process", action="store_true",
                        help="a fresh second process reads what a first one stored")
    parser.add_argument("--touched-arena", action="store_true",
                        help="--cross-process: the reader's arena is touched before timing")
    parser.add_argument("--write-cpu", action="store_true",
                        help="CPU time of the tier's writes against plain pwrites")
    parser.add_argument("--role", choices=("writer", "reader", "direct", "direct-pread"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--page-cache", choices=("true", "false"), default="true",
                        help="the tier's page_cache option (durable write and cold read)")
    args = parser.parse_args()
    if args.role:  # one side of --cross-process, in its own process
        torch.set_num_threads(1)  # copies on one thread: two fight over a busy machine
        role = {"writer": cross_writer, "reader": cross_reader,
                "direct": cross_direct_reader,
                "direct-pread": partial(cross_direct_reader, mapped=False)}[args.role]
        print(json.dumps(role(args.work, args.chunks, args.page_cache == "true",
                              args.touched_arena)))
        return

    kind = fs_type(args.dir.resolve())
    if kind in ("tmpfs", "ramfs"):
        sys.exit(f"{args.dir} is on {kind}: pick a directory on a disk")
    if args.cross_process:
        cross_process_main(args)
        return
    if args.write_cpu:
        write_cpu_main(args)
        return
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
          f"{args.rounds} rounds, page_cache: {args.page_cache}")
    rows = []
    try:
        for r in range(args.rounds):
            row = one_round(work, chunks, keys, read_arena, args.io_threads,
                            args.page_cache == "true")
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
