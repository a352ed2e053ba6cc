"""The mooncake tier against Mooncake's own Python client and the redis tier.

Starts a ``mooncake_master`` and a ``redis-server`` on loopback ports, and a
holder process that lends the pool its memory (one segment), so every client
here is a pure client moving bytes over the transfer engine (TCP here) as an
engine of a fleet would. Then, in the same run:

- put and get of 32 MiB chunks (Llama-3-8B KV of 256 tokens, bf16) through the
  tier (``batched_submit_put`` / ``batched_get_non_blocking``: framing, checksum,
  decode into lmkv's arena), through Mooncake's own client moving the same
  frame bytes between registered buffers with no checks, both with its batch
  calls (``batch_put_from`` / ``batch_get_into``) and, where the store has
  them, its session calls (one ranged call for every object's bytes), and
  through the redis tier. The tier is compared with the faster of the own
  client's two for each direction, and with its session calls followed
  (get) or preceded (put) by the xxh3 of every frame the tier must compute:
  what the tier does, without overlapping the two;
- a lookup of 128 keys through the tier, counting the calls into the store.

Prints each figure and the ratios (targets: tier >= 0.9 of the own client for
put and get, >= the redis tier; the lookup in one call).

    python benchmarks/bench_mooncake.py            # about a minute
    python benchmarks/bench_mooncake.py --quick
    python benchmarks/bench_mooncake.py --no-zero-copy   # + the tier copying through staging
    python benchmarks/bench_mooncake.py --real-client    # through a mooncake_client

``--real-client`` puts a ``mooncake_client`` (Mooncake's standalone real
client) where the holder was: it holds the segment, and the tier
(``client_address``) and the own client (``setup_dummy``, buffers from the
memory it maps) move bytes through shared memory with it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import xxhash

from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, MemoryObj
from lmkv_backends.serde.naive import NaiveSerializer

MiB = 1 << 20
SHAPE = (32, 2, 256, 8, 128)  # Llama-3-8B KV of one 256-token chunk: 32 MiB in bf16
DTYPE = torch.bfloat16
META = KeyMeta("bench-mooncake", 1, 0, "bfloat16", "l2thd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.05)


def master_binary(name: str = "mooncake_master") -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        sys.exit(f"{name} not found: pip install 'lmkv-mooncake[cpu]'")
    return found


@contextmanager
def services(pool_bytes: int, real_client: bool = False) -> Iterator[dict]:
    """A master, a holder process lending ``pool_bytes`` (or a ``mooncake_client``
    holding it), and a redis-server."""
    rpc, http, metrics, redis_port = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            log = open(Path(tmp) / "master.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen(
                [master_binary(), "--rpc_address", "127.0.0.1", "--rpc_port", str(rpc),
                 "--enable_http_metadata_server=true", "--http_metadata_server_host",
                 "127.0.0.1", "--http_metadata_server_port", str(http),
                 "--metrics_host", "127.0.0.1", "--metrics_port", str(metrics)],
                stdout=log, stderr=subprocess.STDOUT))
            wait_port(rpc, procs[-1], "mooncake_master")
            wait_port(http, procs[-1], "mooncake_master's metadata server")
            where = {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{http}/metadata"}
            if real_client:
                port = free_port()
                procs.append(subprocess.Popen(
                    [master_binary("mooncake_client"), "--host", "127.0.0.1", "--port",
                     str(port), "--master_server_address", where["master"],
                     "--metadata_server", where["metadata"], "--global_segment_size",
                     f"{pool_bytes >> 20}MB", "--protocol", "tcp"],
                    stdout=log, stderr=subprocess.STDOUT))
                wait_port(port, procs[-1], "mooncake_client")
                where["client"] = f"127.0.0.1:{port}"
            holder = "print('ready', flush=True)" if real_client else (
                "import sys; from mooncake.store import MooncakeDistributedStore as S; s = S(); "
                f"code = s.setup('127.0.0.1', '{where['metadata']}', {pool_bytes}, 16 << 20, "
                f"'tcp', '', '{where['master']}'); print('ready' if code == 0 else code, "
                "flush=True); sys.stdin.read(); s.close()")
            procs.append(subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, text=True))
            if procs[-1].stdout.readline().strip() != "ready":
                raise RuntimeError(f"the holder could not set up: see {tmp}/master.log")
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL))
            wait_port(redis_port, procs[-1], "redis-server")
            yield {**where, "redis": f"redis://127.0.0.1:{redis_port}/0"}
        finally:
            for proc in reversed(procs):
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.terminate()
                proc.wait(30)


class Counting:
    """A store whose calls are counted by name (round trips of a lookup)."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)
        return call


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Fastest of ``rounds`` timed calls, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class TierBench:
    """Put / get of the same chunks through a tier, fresh keys every round."""

    def __init__(self, tier: object, objs: list[MemoryObj]) -> None:
        self.tier, self.objs = tier, objs
        self.round = 0
        self.keys: list[CacheKey] = []

    def fresh(self) -> None:
        for key in self.keys:
            self.tier.remove(key)
        self.round += 1
        self.keys = [CacheKey(META, f"{self.round}-{i}".encode().ljust(32, b".")) for i in
                     range(len(self.objs))]

    def put(self) -> None:
        assert self.tier.batched_submit_put(self.keys, self.objs).result() == len(self.objs)

    def get(self) -> None:
        got = self.tier.batched_get_non_blocking("bench", self.keys).result()
        assert len(got) == len(self.keys), f"{len(got)} of {len(self.keys)} read back"
        for obj in got:
            obj.ref_down()


class OwnBench:
    """The same frame bytes through Mooncake's own client, between registered buffers."""

    def __init__(self, where: dict, frames: list[bytes]) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        self.sizes = [len(f) for f in frames]
        total = sum(self.sizes)
        if "client" in where:  # a thin client: buffers in the memory the real client maps
            code = self.store.setup_dummy(2 * total, 16 << 20, where["client"])
            assert code == 0, code
            self.src, self.dst = (np.ctypeslib.as_array(
                (ctypes.c_ubyte * total).from_address(self.store.alloc_from_mem_pool(total)))
                for _ in range(2))
            self.src[:] = np.frombuffer(b"".join(frames), dtype=np.uint8)
        else:
            code = self.store.setup("127.0.0.1", where["metadata"], 0, 16 << 20, "tcp", "",
                                    where["master"])
            assert code == 0, code
            self.src = np.frombuffer(b"".join(frames), dtype=np.uint8).copy()
            self.dst = np.empty_like(self.src)
        for buf in (self.src, self.dst):
            assert self.store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        offsets = np.cumsum([0, *self.sizes[:-1]])
        self.src_ptrs = [self.src.ctypes.data + int(o) for o in offsets]
        self.dst_ptrs = [self.dst.ctypes.data + int(o) for o in offsets]
        self.round = 0
        self.names: list[str] = []

    def fresh(self) -> None:
        for name in self.names:
            self.store.remove(name, True)
        self.round += 1
        self.names = [f"own:{self.round}:{i}" for i in range(len(self.sizes))]

    def put(self) -> None:
        codes = self.store.batch_put_from(self.names, self.src_ptrs, self.sizes)
        assert all(c == 0 for c in codes), codes

    def get(self) -> None:
        got = self.store.batch_get_into(self.names, self.dst_ptrs, self.sizes)
        assert got == self.sizes, got

    def close(self) -> None:
        self.store.close()


class OwnSessions:
    """Mooncake's own client through its session calls (one master call, then
    every object's bytes in one ranged call: its fastest way here), sharing
    ``OwnBench``'s store and buffers."""

    def __init__(self, own: OwnBench, checked: bool = False) -> None:
        self.own, self.store = own, own.store
        self.checked = checked  # + an xxh3 of every frame (what the tier must do)
        self.names: list[str] = []
        self.round = 0

    def _check(self, buffer: np.ndarray) -> None:
        if self.checked:
            start = 0
            for size in self.own.sizes:
                xxhash.xxh3_64_intdigest(buffer[start:start + size])
                start += size

    def fresh(self) -> None:
        for name in self.names:
            self.store.remove(name, True)
        self.round += 1
        tag = "own-c" if self.checked else "own-s"
        self.names = [f"{tag}:{self.round}:{i}" for i in range(len(self.own.sizes))]

    def _ranges(self, call: Callable, ptrs: list[int]) -> list[int]:
        return call(self.names, [[p] for p in ptrs], [[n] for n in self.own.sizes],
                    [[0]] * len(ptrs))

    def put(self) -> None:
        self._check(self.own.src)
        assert self.store.batch_put_session_start(self.names, self.own.sizes) == \
            [0] * len(self.names)
        moved = self._ranges(self.store.batch_put_from_multi_buffer_ranges, self.own.src_ptrs)
        assert moved == self.own.sizes, moved
        assert self.store.batch_put_session_end(self.names) == [0] * len(self.names)

    def get(self) -> None:
        assert self.store.batch_get_session_start(self.names) == [0] * len(self.names)
        moved = self._ranges(self.store.batch_get_into_multi_buffer_ranges, self.own.dst_ptrs)
        assert moved == self.own.sizes, moved
        self.store.batch_get_session_end(self.names)
        self._check(self.own.dst)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=4, help="32 MiB chunks per batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 chunks, 2 rounds")
    parser.add_argument("--no-zero-copy", action="store_true",
                        help="also run the tier with register_arena: false (chunks go "
                             "through staging copies both ways), as its own row")
    parser.add_argument("--real-client", action="store_true",
                        help="a mooncake_client holds the pool; the tier and the own client "
                             "are thin clients of it (shared memory, no TCP between them)")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.rounds = 2, 2
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines
    from lmkv_mooncake import MooncakeBackend, MooncakeOptions
    from lmkv_redis import RedisBackend, RedisOptions

    chunk_bytes = int(np.prod(SHAPE)) * DTYPE.itemsize
    batch = args.chunks * chunk_bytes
    arena = MemoryAllocator(3 * batch + 64 * MiB, pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    objs = []
    for _ in range(args.chunks):
        obj = arena.allocate(SHAPE, DTYPE)
        obj.tensor.copy_(torch.randn(SHAPE, generator=gen).to(DTYPE))
        objs.append(obj)
    serializer = NaiveSerializer()
    frames = [b"".join(serializer.serialize(o, CacheKey(META, bytes(32)))) for o in objs]
    context = BackendContext(serializer=serializer, allocate=arena.allocate)
    with services(pool_bytes=4 * batch + 256 * MiB, real_client=args.real_client) as where:
        if args.real_client:
            connection: dict = {"client_address": where["client"]}
        else:
            connection = {"master_address": where["master"], "metadata_server": where["metadata"],
                          "local_hostname": "127.0.0.1", "global_segment_size": 0}
        tier = MooncakeBackend(MooncakeOptions(
            **connection, local_buffer_size=batch + 16 * MiB, key_prefix="bench:"), context)
        copying = None
        if args.no_zero_copy and not args.real_client:
            copying = MooncakeBackend(MooncakeOptions(
                master_address=where["master"], metadata_server=where["metadata"],
                local_hostname="127.0.0.1", global_segment_size=0, register_arena=False,
                local_buffer_size=batch + 32 * MiB, key_prefix="copy:"), context)
        redis_tier = RedisBackend(RedisOptions(url=where["redis"], key_prefix="bench:"), context)
        own = OwnBench(where, frames)
        benches = {"tier": TierBench(tier, objs), "own": own,
                   "redis": TierBench(redis_tier, objs)}
        if not args.real_client and hasattr(own.store, "batch_put_session_start"):
            benches["own-s"] = OwnSessions(own)
            benches["own-c"] = OwnSessions(own, checked=True)
        if copying is not None:
            benches["copy"] = TierBench(copying, objs)
        # Rounds interleave the three (a busy machine slows them all alike); the
        # first round warms up and is not counted.
        best = {label: {"put": float("inf"), "get": float("inf")} for label in benches}
        for round_ in range(args.rounds + 1):
            for label, bench in benches.items():
                bench.fresh()  # removes the previous round's entries: the pool stays small
                for op in ("put", "get"):
                    t0 = time.perf_counter()
                    getattr(bench, op)()
                    if round_:
                        best[label][op] = min(best[label][op], time.perf_counter() - t0)
        for bench in benches.values():
            bench.fresh()
        results = {label: {op: gbps(batch, t) for op, t in ops.items()}
                   for label, ops in best.items()}

        small = [arena.allocate((2, 2, 16, 2, 32), torch.float16) for _ in range(128)]
        keys = [CacheKey(META, f"lookup-{i}".encode().ljust(32, b".")) for i in range(128)]
        assert tier.batched_submit_put(keys, small).result() == 128
        client = tier.link._client
        counting = Counting(client.store)
        client.store = counting
        hits = tier.batched_async_contains("bench", keys)
        calls = dict(counting.calls)
        lookup = timed(lambda: tier.batched_async_contains("bench", keys), args.rounds * 4)
        client.store = counting._store
        direct = tier.stats()["direct_gets"]
        own.close()
        tier.close()
        if copying is not None:
            copying.close()
        redis_tier.close()

    print(f"{args.chunks} chunks of {chunk_bytes // MiB} MiB per batch, best of {args.rounds} "
          "interleaved rounds, "
          + ("thin clients of one mooncake_client (shared memory)" if args.real_client
             else "TCP on loopback, pure clients of one holder segment"))
    for label, name in (("tier", "lmkv mooncake tier"), ("copy", "tier, register_arena off"),
                        ("own", "Mooncake's own client"), ("own-s", "own client, sessions"),
                        ("own-c", "  + checksums after"),
                        ("redis", "lmkv redis tier")):
        if label not in results:
            continue
        r = results[label]
        print(f"  {name:24s} put {r['put']:6.2f} GB/s   get {r['get']:6.2f} GB/s")
    t, r = results["tier"], results["redis"]
    # The limit is the own client's fastest calls for each direction.
    o = {op: max(results[label][op] for label in ("own", "own-s") if label in results)
         for op in ("put", "get")}
    print(f"  tier / own client:  put {t['put'] / o['put']:.2f}   get {t['get'] / o['get']:.2f}"
          "   (target >= 0.9; against its faster calls)")
    if "own-c" in results:  # the same checks, one after the other: what overlap buys
        c = results["own-c"]
        print(f"  tier / own client + checksums after:  put {t['put'] / c['put']:.2f}   "
              f"get {t['get'] / c['get']:.2f}")
    print(f"  tier / redis tier:  put {t['put'] / r['put']:.2f}   get {t['get'] / r['get']:.2f}"
          "   (target >= 1)")
    if "copy" in results:
        c = results["copy"]
        print(f"  zero-copy / staging copies: put {t['put'] / c['put']:.2f}   "
              f"get {t['get'] / c['get']:.2f}")
    print(f"  tier gets read straight into lmkv's arena: {direct} chunks")
    print(f"  lookup of 128 keys: {hits} hits, {lookup * 1e3:.2f} ms, store calls {calls} "
          "(target: one batch_is_exist)")


if __name__ == "__main__":
    main()
