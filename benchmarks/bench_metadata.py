"""Host memory per stored chunk: what a tier's index costs beside the KV it holds.

Each measurement runs in a fresh process and reads its resident memory
(``/proc/self/statm``) before and after; the figure is the growth per entry,
minus the payload (the arena bytes the chunks take), with the keys the tier
keeps counted (the caller's own list of keys is dropped before the second
reading, so a key counts once, wherever it lives).

- ``cpu``: tiny chunks (256 bytes) stored in a cpu tier with each eviction
  policy, the way the storage manager stores them (allocate, fill, put).
- ``fs``: the fs tier's index after start-up found N entries in its directory
  (each name parsed to its key, adopted with its size), without writing N files.

The baseline, in the same run: a bare ``dict`` from the same keys to ``None``,
the least any dict-keyed index can cost.

    python benchmarks/bench_metadata.py                  # 200k cpu chunks, 1M fs entries
    python benchmarks/bench_metadata.py --cpu 50000 --fs 100000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


_META = None


def _keys(n: int, start: int = 0) -> list:
    """Keys ``start`` to ``start + n`` of one model, as a chunker makes them (one
    meta, a 32-byte chunk hash each)."""
    from lmkv.keys.chunking import CacheKey, KeyMeta, kv_geometry

    global _META
    if _META is None:
        _META = KeyMeta("bench-model", geometry=kv_geometry(2, 2, 64))
    return [CacheKey(_META, i.to_bytes(8, "little") * 4) for i in range(start, start + n)]


def measure_dict(n: int) -> dict:
    from lmkv.keys.chunking import CacheKey, KeyMeta  # noqa: F401  (imported before the reading)

    before = _rss()
    keys = _keys(n)
    index = dict.fromkeys(keys)
    del keys
    return {"bytes": _rss() - before, "entries": len(index)}


def measure_cpu(n: int, policy: str) -> dict:
    import torch

    from lmkv.config.model import load_config
    from lmkv.contracts.policy import EvictionContext
    from lmkv.contracts.tier import BackendContext

    payload = 256
    config = load_config(env={}, overrides={"lmkv.tiers": [{
        "type": "cpu", "eviction": policy,
        "options": {"max_bytes": n * payload + (1 << 20), "prefault_ahead": 0}}]})
    (tier_config,) = config.plugins.tiers
    tier = tier_config.backend.create(BackendContext(
        eviction_policy=tier_config.eviction.create(EvictionContext())))
    shape, dtype = (payload // 4,), torch.float32
    obj = tier.allocate(shape, dtype)  # first allocation's one-off costs, not per entry
    obj.ref_down()
    before = _rss()
    step = 256  # the manager stores a prompt's chunks in batches, with their keys
    parent = None
    for start in range(0, n, step):
        batch = _keys(min(step, n - start), start)
        objs = []
        for _ in batch:
            obj = tier.allocate(shape, dtype)
            obj.tensor.fill_(1.0)
            objs.append(obj)
        parents = [parent, *batch[:-1]]
        tier.batched_submit_put(batch, objs, parents).result()
        parent = batch[-1]
        for obj in objs:
            obj.ref_down()
    del batch, objs, parents, parent
    grown = _rss() - before
    return {"bytes": grown - tier.allocator.used_bytes, "entries": len(tier)}


def measure_fs(n: int) -> dict:
    from lmkv.contracts.policy import EvictionContext
    from lmkv.plugins.manager import get_plugin_manager
    from lmkv_backends.tiers.fs_index import EntryIndex, entry_name, key_of

    policy = get_plugin_manager().eviction_policy("lru")(None, EvictionContext())
    index = EntryIndex(policy, None)
    names = [entry_name(key) for key in _keys(n)]  # what a directory listing gives
    before = _rss()
    for start in range(0, n, 4096):  # parsed in batches, as a scan hands them over
        found = [(key_of(name), 65536) for name in names[start:start + 4096]]
        assert all(key is not None for key, _ in found), "an entry name that is no key"
        index.adopt_all(found)
    del found
    grown = _rss() - before
    return {"bytes": grown, "entries": len(index)}


def _child(kind: str, n: int, policy: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--n", str(n),
                          "--policy", policy], capture_output=True, text=True, check=False,
                         timeout=900)
    if out.returncode:
        raise SystemExit(f"{kind} ({policy}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, default=200_000, help="chunks in the cpu tier")
    parser.add_argument("--fs", type=int, default=1_000_000, help="entries in the fs index")
    parser.add_argument("--policies", default="lru,lfu,s3fifo,arc",
                        help="eviction policies of the cpu tier, comma-separated")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="lru", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = {"dict": lambda: measure_dict(args.n), "fs": lambda: measure_fs(args.n),
               "cpu": lambda: measure_cpu(args.n, args.policy)}[args.child]
        print(json.dumps(run()))
        return

    def section(title: str, n: int, rows: list[tuple[str, str, str]]) -> None:
        """A heading, the bare dict of ``n`` keys (the baseline), then each
        ``(label, kind, policy)`` measured in its own process."""
        base = _child("dict", n, "")
        per_base = base["bytes"] / base["entries"]
        print(title)
        print(f"  {'dict of the keys':<24} {base['entries']:>9,} entries  {per_base:7.0f} "
              "B/entry  (baseline)")
        for label, kind, policy in rows:
            got = _child(kind, n, policy)
            per = got["bytes"] / got["entries"]
            print(f"  {label:<24} {got['entries']:>9,} entries  {per:7.0f} B/entry  "
                  f"{per / per_base:5.2f}x the bare dict  {got['bytes'] / 2**20:8.1f} MiB")

    if args.cpu:
        section(f"cpu tier, {args.cpu:,} chunks of 256 B (target: 256 B/entry, key included)",
                args.cpu, [(f"cpu tier, {p}", "cpu", p) for p in args.policies.split(",")])
    if args.fs:
        section(f"fs tier index, {args.fs:,} entries found at start-up (lru)", args.fs,
                [("fs index, lru", "fs", "lru")])

if __name__ == "__main__":
    main()
