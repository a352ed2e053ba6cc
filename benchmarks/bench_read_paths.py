"""Where the time of reading a fs-tier entry into engine memory goes, page cache warm.

The target: a fresh second process loading from disk at most as
slow as vLLM's ExampleConnector (safetensors files: in effect mmap, then one
copy). lmkv's direct reads (``lmkv.contracts.direct_chunk``) pread each piece into a staging
buffer, fold it into the entry's xxh3 checksum, then copy it into the KV: three
passes. This times each pass and the combinations over one file of ``--mib``
MiB in the page cache (best of ``--repeats``), with a plain memcpy of the same
bytes as the baseline of the same run::

    python benchmarks/bench_read_paths.py --dir /var/tmp --mib 64

lmkv maps entries in the page cache under its SIGBUS guard
(docs/tiers/fs.md, "Mapped reads"). The last two rows load the file as 4 MiB
chunks held heads outer (8 layers, 4 KV heads of 64, 256 tokens, float32) into
vLLM-style cpu caches: copied by ``lmkv_kernels.scatter_blocks`` a piece at a
time and each piece hashed after its copy (lmkv's mapped direct reads where the
connector does not check), and in one ``lmkv_kernels.scatter_checked`` call
(its checked loads: each chunk read once, hashed and copied in one pass, one
thread a chunk), where the C copies were built with libxxhash.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable

import torch
import xxhash

LAYERS, HEADS, TOKENS, DIM, BLOCK = 8, 4, 256, 64, 128
CHUNK_BYTES = LAYERS * HEADS * TOKENS * 2 * DIM * 4  # 4 MiB of float32


def paged_rows(path: str, size: int) -> list[tuple[str, Callable[[], None]]]:
    """The file as chunks held heads outer, loaded into cpu-layout caches."""
    import lmkv_kernels
    from lmkv_kernels import host_impl

    chunks = size // CHUNK_BYTES
    blocks = chunks * TOKENS // BLOCK
    caches = [torch.zeros(blocks, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    ids = list(range(blocks))[::-1]
    with open(path, "rb") as f:
        sums = [xxhash.xxh3_64(f.read(CHUNK_BYTES)).intdigest() for _ in range(chunks)]

    def loaded(load: Callable[[list[torch.Tensor]], None]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # (the mapping holds a descriptor of its own)
        whole = memoryview(m)
        bufs = [torch.frombuffer(whole[c * CHUNK_BYTES:(c + 1) * CHUNK_BYTES],
                                 dtype=torch.float32).view(LAYERS, HEADS, TOKENS, 2, DIM)
                for c in range(chunks)]
        try:
            load(bufs)
        finally:  # (no view of the mapping may outlive it)
            del bufs
            whole.release()
            m.close()

    def copy_then_hash(bufs: list[torch.Tensor]) -> None:
        for c, buf in enumerate(bufs):
            lmkv_kernels.scatter_blocks(caches, ids, [(c * TOKENS, buf)], heads_outer=True)
            assert xxhash.xxh3_64(buf.numpy()).intdigest() == sums[c]

    def checked(bufs: list[torch.Tensor]) -> None:
        spans = [(c * TOKENS, (c + 1) * TOKENS, buf, sums[c]) for c, buf in enumerate(bufs)]
        assert lmkv_kernels.scatter_checked(caches, ids, spans) == [True] * chunks

    rows = [("mmap + paged copy, xxh3 after (lmkv)", lambda: loaded(copy_then_hash))]
    if host_impl.can_check():
        rows.append(("mmap + checked paged copy (lmkv)", lambda: loaded(checked)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp", help="a directory on a disk (not tmpfs)")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--piece-mib", type=int, default=4,
                        help="lmkv.contracts.direct_chunk's PIECE_BYTES")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size, piece = args.mib << 20, args.piece_mib << 20
    fd_tmp, path = tempfile.mkstemp(prefix="lmkv-bench-read-", dir=args.dir)
    try:
        with os.fdopen(fd_tmp, "wb") as f:
            f.write(os.urandom(size))
        with open(path, "rb") as f:  # into the page cache
            while f.read(1 << 24):
                pass
        dst = torch.zeros(size, dtype=torch.uint8)
        src = torch.randint(0, 255, (size,), dtype=torch.uint8)
        staging = torch.zeros(piece, dtype=torch.uint8)
        view = memoryview(staging.numpy())

        def preads(then: Callable[[int, int], None]) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while off < size:
                    n = os.preadv(fd, [view[:min(piece, size - off)]], off)
                    then(off, n)
                    off += n
            finally:
                os.close(fd)

        def direct() -> None:  # lmkv.contracts.direct_chunk: pread, checksum, copy, piece by piece
            h = xxhash.xxh3_64()

            def step(off: int, n: int) -> None:
                h.update(view[:n])
                dst[off:off + n].copy_(staging[:n])
            preads(step)
            h.digest()

        def mapped(checksum: bool) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                mapped_view = memoryview(m)
                h = xxhash.xxh3_64()
                for off in range(0, size, piece):
                    n = min(piece, size - off)
                    chunk = torch.frombuffer(mapped_view[off:off + n], dtype=torch.uint8)
                    dst[off:off + n].copy_(chunk)
                    if checksum:
                        h.update(mapped_view[off:off + n])
                    del chunk  # (no view of the mapping may outlive it)
                mapped_view.release()
                m.close()
            finally:
                os.close(fd)

        rows: list[tuple[str, Callable[[], None]]] = [
            ("memcpy (baseline)", lambda: dst.copy_(src)),
            ("xxh3 of the bytes", lambda: xxhash.xxh3_64(src.numpy()).digest()),
            ("pread pieces", lambda: preads(lambda off, n: None)),
            ("pread + copy", lambda: preads(lambda off, n: dst[off:off + n].copy_(staging[:n]))),
            ("pread + xxh3 + copy (lmkv direct)", direct),
            ("mmap + copy (ExampleConnector-like)", lambda: mapped(False)),
            ("mmap + copy + xxh3", lambda: mapped(True)),
        ]
        if size % CHUNK_BYTES == 0:
            rows += paged_rows(path, size)
        base = None
        print(f"{args.mib} MiB in the page cache, {args.piece_mib} MiB pieces, "
              f"best of {args.repeats}")
        for name, fn in rows:
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            base = base or best
            print(f"  {name:<38}{best * 1e3:8.1f} ms  {best / base:5.2f}x memcpy")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    main()
