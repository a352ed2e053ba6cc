"""Round trip of the async lookup channel: scheduler-side client -> worker process -> back.

A worker process holds 32k-token prompts (128 chunks of 256 tokens) in its
cpu tier and serves the channel over ipc:// and tcp:// on loopback. This
process times ``lookup(id, tokens)`` until ``poll(id)`` returns the hit count
(the prompt hashed from a Python list, as a scheduler gets it), and the same
with the hashes computed beforehand (``lookup_hashes``: the channel alone).
Each lookup is then cancelled, so the worker releases what it prefetched.
Baseline, in the same run: the same lookup-and-prefetch called in-process on
an engine holding the same prompts (no channel). Target: p99 under 2 ms.

    python benchmarks/bench_lookup.py            # 10,000 lookups per series
    python benchmarks/bench_lookup.py --lookups 2000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from lmkv import Engine, KVSpec, load_config, open_engine
from lmkv.keys.chunking import prefix_hashes
from lmkv.lookup import LookupClient, LookupEndpoints, LookupResponder

CHUNK = 256
PROMPT_TOKENS = 32 * 1024
PROMPTS = 4
# The lookup path never copies KV, so a small model's KV keeps the setup quick.
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)


def prompts() -> list[list[int]]:
    return [[p * 1_000_000 + t for t in range(PROMPT_TOKENS)] for p in range(PROMPTS)]


def engine_holding_prompts() -> Engine:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                            "lmkv.tiers.0.options.max_bytes": "128MiB"})
    engine = open_engine(config, SPEC, model_name="bench-lookup")
    shape = (1, SPEC.num_kv_heads, PROMPT_TOKENS, SPEC.head_dim)
    kv = [(torch.randn(shape).half(), torch.randn(shape).half())
          for _ in range(SPEC.num_layers)]
    for tokens in prompts():
        assert engine.store(tokens, kv=kv) == PROMPT_TOKENS
    return engine


def worker(conn: Connection, endpoints: list[tuple[str, str]]) -> None:
    engine = engine_holding_prompts()
    responders = [LookupResponder(engine, req, resp, rank=0) for req, resp in endpoints]
    conn.send([s.request_endpoint for s in responders])
    conn.recv()  # until told to stop
    for responder in responders:
        responder.close()
    engine.close()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def timed(n: int, one: Callable[[int], None]) -> list[float]:
    for i in range(min(500, n)):  # warm-up: connections, caches, allocator
        one(-1 - i)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        one(i)
        out.append(time.perf_counter() - t0)
    return out


def channel_series(client: LookupClient, n: int, prehashed: bool) -> list[float]:
    data = prompts()
    hashes = [prefix_hashes(t, CHUNK) for t in data]
    offsets = [CHUNK * (i + 1) for i in range(PROMPT_TOKENS // CHUNK)]
    series = "h" if prehashed else "t"
    latencies = []

    def one(i: int) -> None:
        lookup_id = f"{series}{i}"
        p = i % PROMPTS
        t0 = time.perf_counter()
        if prehashed:
            client.lookup_hashes(lookup_id, hashes[p], offsets)
        else:
            client.lookup(lookup_id, data[p])
        while (hits := client.poll(lookup_id)) is None:
            pass
        latencies.append(time.perf_counter() - t0)
        if hits != PROMPT_TOKENS:
            raise RuntimeError(f"lookup {lookup_id}: {hits} hit tokens, {PROMPT_TOKENS} stored")
        client.cancel(lookup_id)  # the worker releases what it prefetched

    timed(n, one)
    return latencies[-n:]


def in_process_series(n: int) -> list[float]:
    engine = engine_holding_prompts()
    data = prompts()

    def one(i: int) -> None:
        lookup_id = f"direct{i}"
        assert engine.lookup_and_prefetch(data[i % PROMPTS], lookup_id).result() == PROMPT_TOKENS
        engine.release_lookup(lookup_id)

    try:
        return timed(n, one)
    finally:
        engine.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lookups", type=int, default=10_000)
    n = parser.parse_args().lookups

    runtime_dir = tempfile.mkdtemp(prefix="lmkv-bench-", dir="/tmp")
    ipc = LookupEndpoints.ipc("bench", 1, runtime_dir)
    tcp_responses = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=worker, daemon=True, args=(
        child, [(ipc.requests[0], ipc.responses), ("tcp://127.0.0.1:*", tcp_responses)]))
    process.start()
    _, tcp_request = parent.recv()
    tcp = LookupEndpoints((tcp_request,), tcp_responses)

    tokens = prompts()[0]
    hashing = timed(min(n, 2000), lambda i: prefix_hashes(tokens, CHUNK))
    baseline = percentiles(in_process_series(min(n, 2000)))
    print(f"{n} lookups of {PROMPT_TOKENS}-token prompts ({PROMPT_TOKENS // CHUNK} chunks "
          f"of {CHUNK}) against a worker process holding them in its cpu tier")
    print(f"hashing a {PROMPT_TOKENS}-token list: p50 {percentiles(hashing)[0]:.3f} ms")
    print(f"baseline, in-process lookup_and_prefetch from tokens: p50 {baseline[0]:.3f} ms, "
          f"p99 {baseline[1]:.3f} ms")
    print(f"{'transport':<10} {'from':<8} {'p50 ms':>8} {'p99 ms':>8} {'p50/base':>9}")
    for name, endpoints in (("ipc", ipc), ("tcp", tcp)):
        with LookupClient(endpoints, chunk_size=CHUNK, backoff_ms=10) as client:
            for prehashed in (False, True):
                p50, p99 = percentiles(channel_series(client, n, prehashed))
                source = "hashes" if prehashed else "tokens"
                print(f"{name:<10} {source:<8} {p50:>8.3f} {p99:>8.3f} "
                      f"{p50 / baseline[0]:>9.2f}")
    parent.send("stop")
    process.join(10)


if __name__ == "__main__":
    main()
