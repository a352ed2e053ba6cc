"""lmkv server benchmark: chunk throughput through the server against the in-process
cpu tier (same run), and the round trip of lookups of a 32k-token prompt.

    python benchmarks/bench_server.py            # 16 chunks of 32 MiB, 10,000 lookups
    python benchmarks/bench_server.py --quick    # 8 chunks, 2,000 lookups

Targets: store and retrieve through the server >= 0.7 of in-process; lookup
round trip p99 < 2 ms. The server runs as its own process (``python -m
lmkv.server``) on loopback, as in production.

CURVE: a second server with CURVE keys (``lmkv keygen``; docs/security.md) in
the same run: inline store and retrieve with CURVE against without (ratios),
and the lookup round trip with CURVE (target p99 < 2 ms).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from lmkv.config.model import load_config
from lmkv.keys.chunking import CacheKey, KeyMeta, prefix_hashes
from lmkv.rpc.auth import CurveKeys, load_keypair, load_public_key, write_keypair
from lmkv.rpc.client import ServerClient
from lmkv.storage.manager import StorageManager

MiB = 1 << 20
SHAPE = (32, 2, 256, 8, 128)  # Llama-3-8B-like KV of one 256-token chunk, bf16: 32 MiB
CHUNK_BYTES = 32 * 2 * 256 * 8 * 128 * 2
META = KeyMeta("bench-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, port: int, log: Path, *args: str,
                 curve: CurveKeys | None = None) -> subprocess.Popen:
    """The server with its default options (inline stores go in 256 MiB requests)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmkv.server", "--config", str(config), "--port", str(port),
             "--log-level", "WARNING", *args],
            stdout=out, stderr=subprocess.STDOUT)
    client = ServerClient(f"tcp://127.0.0.1:{port}", timeout_ms=500, curve=curve)
    client_log = logging.getLogger("lmkv.rpc.client")
    client_log.setLevel(logging.ERROR)  # "no server yet" while it starts
    deadline = time.monotonic() + 60
    while client.ping() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.1)
    client.close()
    client_log.setLevel(logging.NOTSET)
    return proc


class Round:
    """Fresh keys for every round, so a store is never skipped as already stored."""

    def __init__(self) -> None:
        self.n = 0

    def keys(self, count: int) -> list[CacheKey]:
        self.n += 1
        tokens = [self.n * 1_000_003 + i for i in range(count * 256)]
        return [CacheKey(META, h) for h in prefix_hashes(tokens, 256)]


def best_of(fn: Callable[[], float], rounds: int) -> float:
    fn()  # warm-up: faults the arena pages in
    return min(fn() for _ in range(rounds))


def throughput(label: str, store: Callable[[list[CacheKey]], int],
               retrieve: Callable[[list[CacheKey]], int], n: int, rounds: int,
               gen: Round) -> tuple[float, float]:
    total = n * CHUNK_BYTES

    def timed_store() -> float:
        keys = gen.keys(n)
        t0 = time.perf_counter()
        stored = store(keys)
        elapsed = time.perf_counter() - t0
        assert stored == n, f"{label}: stored {stored} of {n}"
        return elapsed

    stored_keys: list[CacheKey] = []

    def timed_retrieve() -> float:
        if not stored_keys:
            stored_keys.extend(gen.keys(n))
            assert store(stored_keys) == n
        t0 = time.perf_counter()
        got = retrieve(stored_keys)
        elapsed = time.perf_counter() - t0
        assert got == n, f"{label}: retrieved {got} of {n}"
        return elapsed

    store_gbs = total / best_of(timed_store, rounds) / 1e9
    retrieve_gbs = total / best_of(timed_retrieve, rounds) / 1e9
    return store_gbs, retrieve_gbs


def zmq_loopback_gbs(n: int, rounds: int) -> float:
    """The inline path's ceiling: n chunks sent as one multipart message over TCP
    loopback to an echoing ROUTER (one short reply), nothing else."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def echo() -> None:
        while True:
            parts = router.recv_multipart(copy=False)
            router.send_multipart([parts[0].bytes, b"ok"])
            if len(parts) == 2:
                return

    thread = threading.Thread(target=echo)
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    data = [torch.randn(SHAPE).to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy()
            for _ in range(n)]

    def send() -> float:
        t0 = time.perf_counter()
        dealer.send_multipart([b"h", *data], copy=False)
        dealer.recv_multipart()
        return time.perf_counter() - t0

    best = best_of(send, rounds)
    dealer.send_multipart([b"stop"])
    dealer.recv_multipart()
    thread.join()
    dealer.close(0)
    router.close(0)
    ctx.term()
    return n * CHUNK_BYTES / best / 1e9


def bench_throughput(address: str, config: Path, n: int, rounds: int) -> None:
    srcs = [torch.randn(SHAPE).to(torch.bfloat16) for _ in range(n)]
    dsts = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(n)]
    gen = Round()

    storage = StorageManager.from_config(load_config(config))

    def local_store(keys: list[CacheKey]) -> int:
        objs = []
        for src in srcs:
            obj = storage.allocate(SHAPE, torch.bfloat16)
            obj.tensor.copy_(src)
            objs.append(obj)
        stored = storage.put(keys, objs).result()
        for obj in objs:
            obj.ref_down()
        return stored

    def local_retrieve(keys: list[CacheKey]) -> int:
        objs = storage.get(keys)
        for obj, dst in zip(objs, dsts, strict=False):
            dst.copy_(obj.tensor)
            obj.ref_down()
        return len(objs)

    results = {"in-process cpu tier": throughput("local", local_store, local_retrieve, n,
                                                 rounds, gen)}
    storage.close()
    for data_path, label in (("auto", "server, shared memory"), ("inline", "server, inline")):
        client = ServerClient(address, data_path=data_path, timeout_ms=30_000)
        client.ping()
        assert client.shared_memory == (data_path == "auto")
        results[label] = throughput(
            label, lambda keys, c=client: c.store(keys, srcs),
            lambda keys, c=client: len(c.retrieve(keys, out=dsts)), n, rounds, gen)
        client.close()
    ceiling = zmq_loopback_gbs(n, rounds)
    base_store, base_retrieve = results["in-process cpu tier"]
    print(f"\n{n} chunks of 32 MiB {SHAPE} bf16, best of {rounds} rounds:")
    print(f"  {'path':<24} {'store GB/s':>10} {'ratio':>6} {'retrieve GB/s':>14} {'ratio':>6}")
    for label, (st, rt) in results.items():
        print(f"  {label:<24} {st:>10.2f} {st / base_store:>6.2f} {rt:>14.2f} "
              f"{rt / base_retrieve:>6.2f}")
    st, rt = results["server, inline"]
    print(f"  raw ZMQ over TCP loopback (the inline ceiling): {ceiling:.2f} GB/s; "
          f"inline reaches {st / ceiling:.2f} (store) / {rt / ceiling:.2f} (retrieve) of it")


def bench_curve_throughput(plain: str, secured: str, curve: CurveKeys, n: int,
                           rounds: int) -> None:
    """The inline path (the one that crosses machines) with and without CURVE."""
    srcs = [torch.randn(SHAPE).to(torch.bfloat16) for _ in range(n)]
    dsts = [torch.empty(SHAPE, dtype=torch.bfloat16) for _ in range(n)]
    gen = Round()
    results = {}
    for label, address, keys in (("inline", plain, None),
                                  ("inline, CURVE", secured, curve)):
        client = ServerClient(address, data_path="inline", timeout_ms=60_000, curve=keys)
        assert client.ping() is not None, label
        results[label] = throughput(
            label, lambda keys_, c=client: c.store(keys_, srcs),
            lambda keys_, c=client: len(c.retrieve(keys_, out=dsts)), n, rounds, gen)
        client.close()
    base_store, base_retrieve = results["inline"]
    print(f"\nCURVE: {n} chunks of 32 MiB through the inline data path, best of {rounds}:")
    print(f"  {'path':<24} {'store GB/s':>10} {'ratio':>6} {'retrieve GB/s':>14} {'ratio':>6}")
    for label, (st, rt) in results.items():
        print(f"  {label:<24} {st:>10.2f} {st / base_store:>6.2f} {rt:>14.2f} "
              f"{rt / base_retrieve:>6.2f}")


def bench_lookup(address: str, count: int, curve: CurveKeys | None = None,
                 title: str = "") -> None:
    tokens = list(range(32 * 1024))
    hashes = prefix_hashes(tokens, 256)
    ends = [256 * (i + 1) for i in range(len(hashes))]
    keys = [CacheKey(META, h) for h in hashes]
    client = ServerClient(address, timeout_ms=1000, curve=curve)
    small = [torch.zeros(2, 2, 256, 2, 16, dtype=torch.bfloat16) for _ in keys]
    assert client.store(keys, small) == len(keys)

    def round_trips(fn: Callable[[], int], n: int) -> list[float]:
        for _ in range(min(200, n)):
            fn()  # warm-up
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            hit = fn()
            times.append(time.perf_counter() - t0)
            assert hit == ends[-1], hit
        return times

    def report(label: str, times: list[float]) -> None:
        times.sort()
        p50 = statistics.median(times) * 1e3
        p99 = times[int(len(times) * 0.99) - 1] * 1e3
        print(f"  {label:<36} p50 {p50:.3f} ms  p99 {p99:.3f} ms  max {times[-1] * 1e3:.3f} ms")

    print(f"\nlookup round trip{title}, 32k-token prompt (128 chunks), {count} lookups:")
    report("lookup (count only)",
           round_trips(lambda: client.lookup_hashes(META, hashes, ends), count))
    report("lookup + prefetch (waits, 128 chunks)",
           round_trips(lambda: client.lookup_hashes(META, hashes, ends, lookup_id="b"),
                       count // 5))
    client.release_lookup("b")
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and lookups")
    parser.add_argument("--chunks", type=int, help="32 MiB chunks per round (default 16)")
    parser.add_argument("--curve-only", action="store_true",
                        help="only the CURVE comparison and the CURVE lookups")
    args = parser.parse_args()
    n = args.chunks or (8 if args.quick else 16)
    rounds = 2 if args.quick else 5
    lookups = 2_000 if args.quick else 10_000
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bench.yaml"
        # One round's chunks and the lookup prompt: every round after the warm-up
        # reuses (evicts) memory that is already faulted in, in both paths.
        arena = n * CHUNK_BYTES + 16 * MiB
        config.write_text(f"tiers:\n  - type: cpu\n    options: {{max_bytes: {arena}}}\n")
        port = free_port()
        server = start_server(config, port, Path(tmp) / "server.log")
        address = f"tcp://127.0.0.1:{port}"
        servers = [server]
        try:
            print(f"lmkv server benchmark ({os.cpu_count()} cores, torch threads "
                  f"{torch.get_num_threads()})")
            if not args.curve_only:
                bench_throughput(address, config, n, rounds)
                bench_lookup(address, lookups)
            if not zmq.has("curve"):
                print("\nCURVE: this libzmq has no CURVE support; skipped")
                return
            keys = Path(tmp) / "keys"
            _, server_secret = write_keypair(keys, "server")
            client_public, client_secret = write_keypair(keys / "clients", "engine")
            public, secret = load_keypair(client_secret)
            curve = CurveKeys(public, secret,
                              server_key=load_public_key(keys / "server.key"))
            curve_port = free_port()
            servers.append(start_server(config, curve_port, Path(tmp) / "curve.log",
                                        "--curve-secret-key", str(server_secret),
                                        "--curve-authorized-keys", str(client_public),
                                        curve=curve))
            secured = f"tcp://127.0.0.1:{curve_port}"
            bench_curve_throughput(address, secured, curve, n, rounds)
            if args.curve_only:  # the baseline, in this run
                bench_lookup(address, lookups, None, " without CURVE")
            bench_lookup(secured, lookups, curve, " with CURVE")
        finally:
            for srv in servers:
                srv.send_signal(signal.SIGTERM)
            for srv in servers:
                srv.wait(60)


if __name__ == "__main__":
    main()
