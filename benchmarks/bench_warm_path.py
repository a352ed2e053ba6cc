"""lmkv's own time on a warm request (lookup, then load into the engine's paged
KV) against a memcpy of the same bytes in the same process and run.

The engine is lmkv's local engine with the paged connector over vLLM's CPU
layout, for ``bench_vllm.py``'s model (8 layers, 4 KV heads of 64, float32,
128-token blocks, 256-token chunks). For N = 512, 2048 and 4096 tokens:

* ``memory``: the prompt is in the cpu tier (stored by this process): lookup
  and load of the whole prompt;
* ``disk``: the prompt was stored into the fs tier by another process; a fresh
  process opens the tier, looks the prompt up and loads it (direct reads: from
  the page cache into the KV, each entry verified), the first request of that
  process as in a restarted engine;
* ``server`` (not run by default): the memory path in server mode: an ``lmkv
  server`` (a cpu tier in shared memory) holds the prompt this process stored
  through it; lookup (the server lends the chunks with its answer) and load
  out of its arena.

The baseline is ``torch.Tensor.copy_`` of N tokens' KV (the same bytes) between
two touched buffers, best of ``--repeats``; for the memory path also the
median of paired ratios (``paired``: each lookup + load over a memcpy timed
just before it). Every timed sample, lmkv's and the
memcpy's alike, starts with the CPU's caches holding other data (96 MiB
written first: many times the cores' own caches; the 260 MiB L3 this VM
reports is its host's, shared with other machines), as a warm
request finds them after the forwards since its KV was stored: a memcpy of 8
MiB between buffers still in the cache runs several times faster than one
from memory, and no request loads KV that is. Target: lookup + load at most
1.3x the memcpy.

    python benchmarks/bench_warm_path.py --repeats 7
    python benchmarks/bench_warm_path.py --paths memory --repeats 40
    python benchmarks/bench_warm_path.py --paths memory,server --repeats 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

LAYERS, HEADS, DIM, BLOCK, CHUNK = 8, 4, 64, 128, 256
DTYPE = torch.float32
LENGTHS = (512, 2048, 4096)
BLOCKS = 2 * max(LENGTHS) // BLOCK  # room for a stored copy and a loaded one


def engine(root: str | None, direct: bool, server: str = ""):  # type: ignore[no-untyped-def]
    from lmkv import load_config
    from lmkv.engines import open_engine
    from lmkv.testing.engines import open_local_engine
    from lmkv_backends.connectors.paged import PagedConnector

    tiers: list = [{"type": "cpu", "options": {"max_bytes": "1GiB"}}]
    if root is not None:
        tiers.append({"type": "fs", "options": {"url": root}})
    overrides = {"lmkv.chunk_size": CHUNK, "lmkv.gpu_connector": "paged", "lmkv.tiers": tiers}
    if server:
        overrides.update({"lmkv.mode": "server", "lmkv.server.address": server,
                          "lmkv.server.timeout_ms": 2000})
    config = load_config(env={}, overrides=overrides)
    # the spec the vLLM worker gets: read from the caches by the paged connector
    # (cpu caches: chunks held heads outer, KVSpec.heads_outer)
    spec = PagedConnector.spec_from(kv_caches=caches(fill=False)[:1] * LAYERS)
    opener = open_engine if server else open_local_engine
    return opener(config, spec, model_name="bench-warm-path", kv_kind="paged",
                  block_size=BLOCK, direct_reads=direct)


def caches(fill: bool) -> list[torch.Tensor]:
    """vLLM CPU-layout caches ``[blocks, heads, block, 2 * dim]``, touched."""
    make = torch.randn if fill else torch.zeros
    return [make(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=DTYPE) for _ in range(LAYERS)]


def prompt(n: int) -> list[int]:
    return [(n * 7919 + i) % 32000 for i in range(n)]


_SCRATCH: list[torch.Tensor] = []


def cold_caches() -> None:
    """Fill the CPU's caches with other data (96 MiB written)."""
    if not _SCRATCH:
        _SCRATCH.append(torch.zeros(96 << 20, dtype=torch.uint8))
    _SCRATCH[0].add_(1)


def memcpy_ms(n: int, repeats: int) -> float:
    nbytes = n * LAYERS * 2 * HEADS * DIM * DTYPE.itemsize
    src, dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        cold_caches()
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def timed(eng, n: int, kv: list[torch.Tensor], tag: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    tokens = prompt(n)
    cold_caches()
    start = time.perf_counter()
    hit = eng.lookup_and_prefetch(tokens, tag).result(30)
    looked = time.perf_counter()
    loaded = eng.retrieve(tokens, lookup_id=tag, kv_caches=kv,
                          block_ids=list(range(BLOCKS // 2, BLOCKS // 2 + n // BLOCK))).num_tokens
    done = time.perf_counter()
    assert hit == loaded == n, f"{n} tokens: hit {hit}, loaded {loaded}"
    return (looked - start) * 1e3, (done - looked) * 1e3


def memory(repeats: int, server: str = "") -> dict[str, list[float]]:
    """Per length: best lookup + load, median lookup, median load, best memcpy,
    and the median of paired ratios (each sample's lookup + load over a memcpy
    timed just before it, so both see the machine alike). ``server``: an lmkv
    server's address (server mode, its cpu tier in shared memory)."""
    out: dict[str, list[float]] = {}
    with engine(None, direct=False, server=server) as eng:
        src = caches(fill=True)
        kv = caches(fill=False)
        for n in LENGTHS:
            assert eng.store(prompt(n), kv_caches=src, block_ids=list(range(n // BLOCK))) == n
            samples, pairs = [], []
            for i in range(repeats):
                base = memcpy_ms(n, 1)
                samples.append(timed(eng, n, kv, f"m{n}-{i}"))
                pairs.append((samples[-1][0] + samples[-1][1]) / base)
            out[str(n)] = [min(s[0] + s[1] for s in samples),
                           statistics.median(s[0] for s in samples),
                           statistics.median(s[1] for s in samples), memcpy_ms(n, repeats),
                           statistics.median(pairs)]
    return out


def write(root: str) -> None:
    with engine(root, direct=False) as eng:
        src = caches(fill=True)
        for n in LENGTHS:
            assert eng.store(prompt(n), kv_caches=src, block_ids=list(range(n // BLOCK))) == n
        assert eng.storage.flush(120), "disk writes unfinished"


def read(root: str, n: int, repeats: int) -> list[float]:
    kv = caches(fill=False)
    base = memcpy_ms(n, repeats)  # (also warms the copy paths up, as an engine's forward)
    with engine(root, direct=True) as eng:
        # An engine restarts seconds before its first request (vLLM loads the model
        # after lmkv's tiers are made): the cpu tier's background prefault of its
        # arena is over by then, and does not take a CPU from this request.
        prefaulter = eng.storage.tiers[0].allocator.prefaulter
        if prefaulter is not None:
            prefaulter.wait(30)
        lookup, load = timed(eng, n, kv, "first")
    return [lookup + load, lookup, load, base]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default="memory,disk",
                        help="which paths to time, of memory, disk, server "
                             "(default memory,disk)")
    parser.add_argument("--role", choices=("write", "read"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.role == "write":
        write(args.root)
        return
    if args.role == "read":
        print(json.dumps(read(args.root, args.tokens, args.repeats)))
        return
    paths = {"memory", "disk"} if args.paths == "both" else set(args.paths.split(","))
    if not paths or paths - {"memory", "disk", "server"}:
        raise SystemExit(f"--paths: {args.paths!r}; allowed: memory, disk, server, "
                         "comma-separated")
    rows = {}
    if "memory" in paths:
        rows["memory"] = memory(args.repeats)
    if "server" in paths:
        rows["server"] = served(args.repeats)
    if "disk" in paths:
        rows["disk"] = disk(args.repeats)
    print_rows(rows, args.repeats)


def served(repeats: int) -> dict[str, list[float]]:
    """The memory path in server mode: an lmkv server (cpu tier, shared memory)
    holds the prompts this process stored through it."""
    from lmkv.testing.server import spawn_server

    with tempfile.TemporaryDirectory(prefix="lmkv-bench-warm-") as tmp:
        proc, address = spawn_server(
            tmp, "tiers:\n  - type: cpu\n    options: {max_bytes: 1GiB}\n")
        try:
            return memory(repeats, server=address)
        finally:
            proc.terminate()
            proc.wait(60)


def disk(repeats: int) -> dict[str, list[float]]:
    """Per length, medians over ``repeats`` fresh processes reading the fs tier."""
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-warm-", dir="/var/tmp") as root:
        me = [sys.executable, __file__, "--root", root, "--repeats", str(repeats)]
        subprocess.run([*me, "--role", "write"], check=True)
        runs: dict[str, list[list[float]]] = {str(n): [] for n in LENGTHS}
        for _ in range(repeats):
            for n in LENGTHS:
                got = subprocess.run([*me, "--role", "read", "--tokens", str(n)], check=True,
                                     capture_output=True, text=True).stdout
                runs[str(n)].append(json.loads(got))
    return {n: [statistics.median(s[k] for s in samples) for k in range(4)]
            for n, samples in runs.items()}


def print_rows(rows: dict[str, dict[str, list[float]]], repeats: int) -> None:
    print(f"lmkv's own time on a warm request vs memcpy of the same bytes ({DTYPE}, "
          f"{LAYERS} layers x {HEADS} heads x {DIM}; memory, server: best lookup+load "
          f"of {repeats} and medians of each; disk: medians over {repeats} fresh "
          "processes)")
    print(f"{'path':<8}{'tokens':>7}{'MiB':>6}{'lookup':>9}{'load':>8}{'l+l':>8}"
          f"{'memcpy':>8}{'x memcpy':>10}{'paired':>8}")
    for path, by_n in rows.items():
        for n, (both, lookup, load, base, *paired) in by_n.items():
            mib = int(n) * LAYERS * 2 * HEADS * DIM * DTYPE.itemsize / (1 << 20)
            print(f"{path:<8}{n:>7}{mib:>6.0f}{lookup:>9.2f}{load:>8.2f}{both:>8.2f}"
                  f"{base:>8.2f}{both / base:>10.2f}"
                  + (f"{paired[0]:>8.2f}" if paired else f"{'':>8}"))
    print(f"load average {os.getloadavg()[0]:.1f}; target: x memcpy <= 1.3")


if __name__ == "__main__":
    main()
