"""The peer tier's reads against the same bytes moved by ZeroMQ alone, in one run.

A holder process stores chunks shaped like Llama-3-8B KV (32 layers, K and V,
8 KV heads, head size 128, bf16: 32 MiB per 256-token chunk) in its cpu tier
and serves them through its peer endpoint; this process (no ``listen``: every
chunk is the holder's) reads them through the ``peer`` tier into its own cpu
tier's buffers, every frame decoded and verified. The baselines, served by the
same holder over the same transport from the same frames, taken in turns with
the tier's reads:

* ``zmq``: one request, the frames back in one reply (ZeroMQ, no lmkv), each
  copied into a buffer of this process (where the tier's decode puts them);
* ``zmq+xxh3``: the same, and each payload hashed (what the tier's verify costs).

Ratios are of throughput (GB/s), tier over baseline (target: >= 0.9 of the
plain move before checksums). ``--transport tcp`` runs over loopback TCP with
CURVE (the tier's tcp path); the default is ``ipc``.

    python benchmarks/bench_peer.py                  # about a minute
    python benchmarks/bench_peer.py --chunks 4 --rounds 5 --transport tcp
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import xxhash
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (32, 2, 256, 8, 128)
HOLDER = r"""
import sys, torch, zmq
from lmkv import load_config
from lmkv.storage import StorageManager
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import release
address, raw, chunks, curve = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
options = {"listen": address, "peers": [address]}
if curve:
    options["curve"] = {"secret_key": curve}
manager = StorageManager.from_config(load_config(env={}, overrides={"lmkv.tiers": [
    {"type": "cpu", "options": {"max_bytes": f"{chunks * 40 + 64}MiB"}},
    {"type": "peer", "options": options}]}))
shape = tuple(int(x) for x in sys.argv[5].split(","))
keys = [CacheKey(KeyMeta("bench-peer"), i.to_bytes(4, "little") * 4) for i in range(chunks)]
objs = []
for i, key in enumerate(keys):
    obj = manager.allocate(shape, torch.bfloat16)
    obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
    objs.append(obj)
manager.put(keys, objs).result(60)
serializer = manager.tiers[1].context.serializer
frames = [b"".join(serializer.serialize(o, k)) for o, k in zip(objs, keys)]
release(objs)
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(raw)
print("ready", flush=True)
while True:
    envelope, request = sock.recv_multipart()
    if request == b"stop":
        break
    sock.send_multipart([envelope, b"", *frames], copy=False)
manager.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    args = parser.parse_args()
    from lmkv import load_config
    from lmkv.keys.chunking import CacheKey, KeyMeta
    from lmkv.memory import release
    from lmkv.rpc.auth import write_keypair
    from lmkv.storage import StorageManager

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-peer-") as tmp:
        curve = ""
        if args.transport == "tcp":
            import socket
            ports = []
            for _ in range(2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    ports.append(s.getsockname()[1])
            address, raw = (f"tcp://127.0.0.1:{port}" for port in ports)
            curve = str(write_keypair(os.path.join(tmp, "keys"), "fleet")[1])
        else:
            address, raw = f"ipc://{tmp}/fleet/holder.sock", f"ipc://{tmp}/raw.sock"
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, address, raw, str(args.chunks), curve,
             ",".join(map(str, SHAPE))], cwd=ROOT, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT})
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise SystemExit("the holder did not start")
        options: dict = {"peers": [address], "timeout_ms": 60_000}
        if curve:
            options["curve"] = {"secret_key": curve}
        reader = StorageManager.from_config(load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "cpu", "options": {"max_bytes": f"{args.chunks * 40 + 64}MiB"}},
            {"type": "peer", "options": options}]}))
        peer = reader.tiers[1]
        keys = [CacheKey(KeyMeta("bench-peer"), i.to_bytes(4, "little") * 4)
                for i in range(args.chunks)]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(raw)
        nbytes = args.chunks * torch.Size(SHAPE).numel() * 2
        landing = [torch.empty(nbytes // args.chunks + 4096, dtype=torch.uint8)
                   for _ in range(args.chunks)]

        def tier() -> None:
            got = peer.batched_get_non_blocking("bench", keys).result(120)
            assert len(got) == len(keys), f"read {len(got)} of {len(keys)}"
            release(got)

        def plain(hashed: bool) -> None:
            sock.send(b"get")
            _, *frames = sock.recv_multipart(copy=False)
            assert len(frames) == len(keys)
            for frame, buf in zip(frames, landing, strict=True):
                view = frame.buffer
                buf[:len(view)].numpy()[:] = memoryview(view).cast("B")
                if hashed:
                    xxhash.xxh3_64_intdigest(buf[:len(view)].numpy())

        cases = {"peer tier": tier, "zmq": lambda: plain(False),
                 "zmq+xxh3": lambda: plain(True)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds + 1):
            order = list(cases.items()) if r % 2 == 0 else list(reversed(cases.items()))
            for name, fn in order:
                start = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - start)
        sock.send(b"stop")
        holder.wait(60)
        sock.close(0)
        reader.close()
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    print(f"peer tier reads, {args.chunks} chunks of {nbytes // args.chunks >> 20} MiB over "
          f"{args.transport}{' (CURVE)' if curve else ''}, median of {args.rounds} "
          f"(load {os.getloadavg()[0]:.1f})")
    for name, value in gbps.items():
        print(f"  {name:10s} {value:6.2f} GB/s")
    print(f"  tier / zmq {gbps['peer tier'] / gbps['zmq']:.2f}   tier / zmq+xxh3 "
          f"{gbps['peer tier'] / gbps['zmq+xxh3']:.2f}   (target >= 0.9 of the plain move)")


if __name__ == "__main__":
    main()
