"""Where the time of reading a fs-tier entry into engine memory goes, page cache warm.

The target: a fresh second process loading from disk at most as
slow as vLLM's ExampleConnector (safetensors files: in effect mmap, then one
copy). lmkv's direct reads (``lmkv.contracts.direct_chunk``) pread each piece into a staging
buffer, fold it into the entry's xxh3 checksum, then copy it into the KV: three
passes. This times each pass and the combinations over one file of ``--mib``
MiB in the page cache (best of ``--repeats``), with a plain memcpy of the same
bytes as the baseline of the same run::

    python benchmarks/bench_read_paths.py --dir /var/tmp --mib 64

``mmap`` rows are for comparison only: an entry truncated while mapped raises
SIGBUS in the reader, so lmkv does not map entries.
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
