"""The host copies on the main thread's OpenMP team against lmkv's helper
threads, right after a torch parallel loop, as a load finds them after an
engine's forward.

A prompt's KV (``bench_warm_path.py``'s model: 8 layers, 4 KV heads of 64,
float32, 128-token blocks, 256-token chunks held heads outer) is scattered
into vLLM-layout CPU caches by ``lmkv_kernels.host_impl`` with its copies on
the team (``use_team(True)``, the default) and on lmkv's helpers
(``use_team(False)``), alternated sample by sample in one process; the
baseline is torch's ``copy_`` of the same bytes between two buffers. Each
sample starts after 96 MiB were written by a torch op (the team's threads
spinning, the CPU's caches holding other data). Medians (best) of
``--repeats``, and each median's ratio to the baseline's.

    python benchmarks/bench_host_team.py --repeats 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_warm_path as w

from lmkv_kernels import host_impl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if not host_impl.available() or not host_impl.use_team(True):
        raise SystemExit("the C copies were not built, or torch does not run on OpenMP "
                         "(or has one thread): nothing to compare")
    kv = w.caches(fill=False)
    print(f"scatter into vLLM CPU caches, {w.DTYPE}, {w.LAYERS} layers x {w.HEADS} heads x "
          f"{w.DIM}; medians (best) of {args.repeats}, ms; x: median over copy_'s")
    print(f"{'tokens':>7}{'MiB':>5}{'team':>15}{'helpers':>15}{'copy_':>15}"
          f"{'team x':>8}{'helpers x':>11}")
    for n in w.LENGTHS:
        chunks = [(start, torch.randn(w.LAYERS, w.HEADS, w.CHUNK, 2, w.DIM,
                                      dtype=w.DTYPE).permute(0, 3, 2, 1, 4))
                  for start in range(0, n, w.CHUNK)]
        ids = list(range(w.BLOCKS // 2, w.BLOCKS // 2 + n // w.BLOCK))
        elements = n * w.LAYERS * 2 * w.HEADS * w.DIM
        src, dst = torch.randn(elements, dtype=w.DTYPE), torch.zeros(elements, dtype=w.DTYPE)
        samples: dict[str, list[float]] = {"team": [], "helpers": [], "copy_": []}
        for _ in range(args.repeats):
            for way in samples:
                if way != "copy_":
                    host_impl.use_team(way == "team")
                w.cold_caches()
                start = time.perf_counter()
                if way == "copy_":
                    dst.copy_(src)
                else:
                    host_impl.scatter_blocks(kv, ids, chunks, layout="cpu")
                samples[way].append((time.perf_counter() - start) * 1e3)
        host_impl.use_team(True)
        med = {k: statistics.median(v) for k, v in samples.items()}
        cells = "".join(f"{f'{med[k]:.2f} ({min(v):.2f})':>15}" for k, v in samples.items())
        mib = elements * w.DTYPE.itemsize / (1 << 20)
        print(f"{n:>7}{mib:>5.0f}{cells}{med['team'] / med['copy_']:>8.2f}"
              f"{med['helpers'] / med['copy_']:>11.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
