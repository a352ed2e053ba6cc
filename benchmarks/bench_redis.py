"""The redis tier against redis-benchmark, on one redis-server started here.

Puts and gets of 256-token chunks shaped like Llama-3-8B KV (32 layers, K and
V, 8 KV heads, head size 128, bf16: 32 MiB each) through the tier, next to
``redis-benchmark -t set,get -d <frame size> -c 1 -P 1`` on the same server
in the same run, as ratios (target >= 0.8 both ways). Then a lookup of 128
keys, counting the commands the server ran and the times the client sent.

    python benchmarks/bench_redis.py             # about a minute
    python benchmarks/bench_redis.py --quick
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
import torch

from lmkv.config.model import load_config
from lmkv.contracts.serde import SerializerContext
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, MemoryObj

MiB = 1 << 20
SHAPE = (32, 2, 256, 8, 128)  # Llama-3-8B KV of one 256-token chunk


@contextmanager
def redis_server() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            yield port
        finally:
            proc.terminate()
            proc.wait(10)


def redis_benchmark(port: int, test: str, size: int, n: int) -> float:
    """Requests per second of ``redis-benchmark -t TEST -d SIZE -n N -c 1 -P 1``."""
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-t", test, "-d", str(size),
                          "-n", str(n), "-c", "1", "-P", "1", "-q"],
                         capture_output=True, text=True, timeout=600).stdout
    found = re.findall(r"([\d.]+) requests per second", out.replace("\r", "\n"))
    if not found:
        raise RuntimeError(f"cannot read redis-benchmark's output: {out[-300:]!r}")
    return float(found[-1])


def best_of(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_tier(port: int, arena: MemoryAllocator, **options: object):
    config = load_config(env={}, overrides={"lmkv.serializer": "naive", "lmkv.tiers": [
        {"type": "redis", "options": {"url": f"redis://127.0.0.1:{port}/0", **options}}]})
    plugins = config.plugins
    return plugins.tiers[0].backend.create(BackendContext(
        serializer=plugins.serializer.create(SerializerContext()), allocate=arena.allocate))


@contextmanager
def count_sends(tier) -> Iterator[list[int]]:
    """Counts the times the tier's connections send (one per round trip)."""
    cls = tier.connection.client().connection_pool.connection_class
    original = cls.send_packed_command
    own = "send_packed_command" in vars(cls)
    sends = [0]

    def counting(self, command, check_health=True):
        sends[0] += 1
        return original(self, command, check_health)

    cls.send_packed_command = counting
    try:
        yield sends
    finally:
        if own:
            cls.send_packed_command = original
        else:
            del cls.send_packed_command


def bench_throughput(port: int, n_chunks: int, rounds: int) -> None:
    chunks = [torch.randn(SHAPE).to(torch.bfloat16) for _ in range(n_chunks)]
    chunk_bytes = chunks[0].numel() * chunks[0].element_size()
    arena = MemoryAllocator(n_chunks * (chunk_bytes + MiB), pin_memory=False)
    objs = []
    for data in chunks:
        obj = arena.allocate(SHAPE, torch.bfloat16)
        obj.tensor.copy_(data)
        objs.append(obj)
    get_arena = MemoryAllocator(n_chunks * (chunk_bytes + MiB), pin_memory=False)
    tier = make_tier(port, get_arena)
    meta = KeyMeta("bench-redis", dtype="bfloat16")
    keys = [CacheKey(meta, i.to_bytes(32, "little")) for i in range(n_chunks)]
    frame_bytes = len(tier.context.serializer.frame_bytes(objs[0], keys[0]))

    def put() -> None:
        assert tier.batched_submit_put(keys, objs).result() == n_chunks

    got: list[MemoryObj] = []

    def get() -> None:
        assert tier.batched_async_contains("bench", keys, pin=True) == n_chunks
        got.extend(tier.batched_get_non_blocking("bench", keys).result())
        assert len(got) == n_chunks
        for key in keys:
            tier.unpin(key)
        for obj in got:
            obj.ref_down()
        got.clear()

    put()  # warm-up: connections, server memory
    get()
    # Rounds interleave the tier and redis-benchmark, so that a burst of load on
    # the (shared, noisy) machine hits both sides of a ratio alike.
    server = redis.Redis(port=port)
    n_bench = n_chunks * 2
    put_ratios, get_ratios, figures = [], [], []
    for _ in range(rounds):
        set_rps = redis_benchmark(port, "set", frame_bytes, n_bench)
        t_put = best_of(put, 1)
        get_rps = redis_benchmark(port, "get", frame_bytes, n_bench)
        t_get = best_of(get, 1)
        server.delete("key:__rand_int__")
        base_set, base_get = set_rps * chunk_bytes, get_rps * chunk_bytes
        ours_put, ours_get = n_chunks * chunk_bytes / t_put, n_chunks * chunk_bytes / t_get
        put_ratios.append(ours_put / base_set)
        get_ratios.append(ours_get / base_get)
        figures.append((base_set, ours_put, base_get, ours_get))
    obj = tier.get_blocking(keys[0])
    assert obj is not None and torch.equal(obj.tensor, chunks[0])
    obj.ref_down()
    tier.close()
    for obj in objs:
        obj.ref_down()

    gb = 1e9
    print(f"\n[throughput] {n_chunks} chunks of {chunk_bytes / MiB:.0f} MiB {SHAPE} bf16 "
          f"(frames of {frame_bytes:,} bytes), {rounds} rounds")
    print("  GB/s per round: redis-benchmark SET | tier put | redis-benchmark GET | tier get")
    for base_set, ours_put, base_get, ours_get in figures:
        print(f"    {base_set / gb:5.2f} | {ours_put / gb:5.2f} | {base_get / gb:5.2f} | "
              f"{ours_get / gb:5.2f}")
    print(f"  put / SET ratio: median {statistics.median(put_ratios):.2f} "
          f"(min {min(put_ratios):.2f})   target >= 0.8")
    print(f"  get / GET ratio: median {statistics.median(get_ratios):.2f} "
          f"(min {min(get_ratios):.2f})   target >= 0.8")


def bench_lookup(port: int, n_keys: int = 128) -> None:
    arena = MemoryAllocator(64 * MiB, pin_memory=False)
    tier = make_tier(port, arena)
    meta = KeyMeta("bench-lookup", dtype="bfloat16")
    keys = [CacheKey(meta, i.to_bytes(32, "little")) for i in range(n_keys)]
    objs = []
    for _ in keys:
        obj = arena.allocate((2, 2, 16, 2, 32), torch.bfloat16)
        obj.tensor.zero_()
        objs.append(obj)
    assert tier.batched_submit_put(keys, objs).result() == n_keys
    for obj in objs:
        obj.ref_down()
    server = redis.Redis(port=port)
    server.config_resetstat()
    with count_sends(tier) as sends:
        t0 = time.perf_counter()
        hits = tier.batched_async_contains("bench", keys)
        elapsed = time.perf_counter() - t0
    calls = server.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)
    print(f"\n[lookup] batched contains of {n_keys} keys: {hits} hits, {calls} GETRANGE "
          f"commands in {sends[0]} send (round trip{'s' if sends[0] != 1 else ''}), "
          f"{elapsed * 1e3:.2f} ms")
    tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and rounds")
    parser.add_argument("--chunks", type=int, default=None, help="chunks per batch")
    args = parser.parse_args()
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        raise SystemExit("redis-server and redis-benchmark must be installed")
    n_chunks = args.chunks or (4 if args.quick else 8)
    rounds = 2 if args.quick else 5
    with redis_server() as port:
        print(f"redis-server {redis.Redis(port=port).info('server')['redis_version']} "
              f"on 127.0.0.1:{port}; redis-py {redis.__version__}")
        bench_throughput(port, n_chunks, rounds)
        bench_lookup(port)


if __name__ == "__main__":
    main()
