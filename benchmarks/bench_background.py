"""What lmkv's background stores cost a load that runs beside them, on a busy CPU.

A fresh engine process that has just stored new prompts keeps writing them to
its lower tiers (write-through to the ``fs`` tier: copies into the page cache,
and ``fdatasync`` with ``durable``, as here) while the next request loads its
prefix. Where the engine's other CPUs are taken (vLLM's CPU build binds an
OpenMP thread to each), the storing threads and the loading thread share one
CPU.

This pins the whole process to one CPU and times a foreground load (``--mib``
MiB from a file in the page cache, 4 MiB pieces read into a staging buffer and
copied into a destination tensor, as a direct load from the fs tier does),
median of ``--rounds``:

* ``alone``: nothing in the background (the baseline of the run);
* ``stores, nice 0``: a real storage manager (cpu + durable fs tier) storing
  fresh 4 MiB chunks in a loop, its write-through threads at the process's
  priority;
* ``stores, nice N``: the same with the storing threads ``N`` nice levels
  below the process (``lmkv.base.affinity.BACKGROUND_NICE``, lmkv's default).

Rounds of the three alternate. Ratios are against ``alone`` in the same run::

    .venv/bin/python benchmarks/bench_background.py [--dir /var/tmp] [--mib 64] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch

from lmkv.base import affinity
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.storage.manager import StorageManager
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_backends.tiers.fs import FSBackend
from lmkv_policies.lru import LRUPolicy

PIECE = 4 << 20
CHUNK_SHAPE = (8, 2, 256, 4, 64)  # bench_vllm.py's chunks: 4 MiB of float32


def foreground(path: str, size: int, staging: torch.Tensor, dst: torch.Tensor) -> float:
    """One load: seconds to read ``path`` piece by piece and copy each into ``dst``."""
    view = memoryview(staging.numpy())
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < size:
            n = os.preadv(fd, [view], off)
            dst[off:off + n].copy_(staging[:n])
            off += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0


class Stores:
    """A storage manager storing fresh chunks in a loop until stopped."""

    def __init__(self, root: str, nice: int) -> None:
        affinity.BACKGROUND_NICE = nice  # read by the storing threads as they start
        cpu = CPUBackend(CPUBackend.Options(max_bytes=256 << 20),
                         BackendContext(eviction_policy=LRUPolicy()))
        fs = FSBackend(FSBackend.Options(url=root, max_bytes=512 << 20, durable=True),
                       BackendContext(eviction_policy=LRUPolicy(),
                                      serializer=NaiveSerializer()))
        self.manager = StorageManager([cpu, fs])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-stores", daemon=True)
        self.stored = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            key = CacheKey(KeyMeta("bench"), os.urandom(32))
            obj = self.manager.allocate(CHUNK_SHAPE, torch.float32)
            if obj is None:
                continue
            obj.tensor.fill_(1.0)
            self.manager.put([key], [obj], [None]).result()
            obj.ref_down()
            self.stored += 1
            time.sleep(0.01)  # a stream of requests, not a tight loop

    def __enter__(self) -> Stores:
        self._thread.start()
        time.sleep(0.2)  # the write-through under way
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.manager.flush(60)
        self.manager.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp", help="a directory on a disk (not tmpfs)")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--nice", type=int, default=affinity.BACKGROUND_NICE)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    size = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-bg-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "source")
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        staging = torch.zeros(PIECE, dtype=torch.uint8)
        dst = torch.zeros(size, dtype=torch.uint8)
        foreground(path, size, staging, dst)  # the source in the page cache
        runs: dict[str, list[float]] = {"alone": [], "stores, nice 0": [],
                                        f"stores, nice {args.nice}": []}
        stored = dict.fromkeys(runs, 0)
        for r in range(args.rounds):
            for name in runs:
                if name == "alone":
                    runs[name].append(foreground(path, size, staging, dst))
                    continue
                nice = 0 if name.endswith("nice 0") else args.nice
                with Stores(os.path.join(tmp, f"fs-{r}-{nice}"), nice) as stores:
                    runs[name].append(foreground(path, size, staging, dst))
                stored[name] += stores.stored
    base = statistics.median(runs["alone"])
    print(f"foreground load of {args.mib} MiB on one CPU, median of {args.rounds}")
    for name, times in runs.items():
        med = statistics.median(times)
        extra = f", {stored[name]} chunks stored meanwhile" if name != "alone" else ""
        print(f"  {name:<18} {med * 1e3:7.1f} ms  {med / base:5.2f}x alone{extra}")


if __name__ == "__main__":
    main()
