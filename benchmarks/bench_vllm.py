"""Time to first token in a real vLLM (CPU build): vLLM's prefix cache vs connectors.

Run with the vLLM venv: ``.venv-vllm/bin/python benchmarks/bench_vllm.py``
(``./scripts/setup-vllm.sh`` makes it).
A random-weight Llama (~107M parameters with embeddings; float32, or
``--dtype bfloat16``: the KV is then half the bytes). For N = 512,
2048 and 4096: TTFT (wall time of ``llm.generate`` with ``max_tokens=1``, greedy)
of a cold prompt (N fresh random tokens plus 16) and of a warm prompt (the first
N tokens of an earlier cold prompt plus 2-16 new ones, so the reusable prefix is
whole lmkv chunks and vLLM blocks), median of 3, in these configurations, each
in its own subprocess:

* ``prefix-cache``: vLLM's own prefix cache, no connector (same-process hit);
* ``example-conn``: vLLM's ``ExampleConnector`` (disk), prefix caching off;
* ``example-conn-2proc``: the same, a first process stores the prompts, a fresh
  second process measures (cold with fresh prompts, warm from the first one's
  files): ``lmkv-2proc``'s baseline when both run;
* ``lmkv``: ``LMKVConnector``, cpu tier (``huge_pages: true``), prefix caching off;
* ``lmkv-2proc``: a first process stores the prompts (cpu + fs tier, flushed);
  a fresh second process measures (cold with fresh prompts, warm from disk);
* ``lmkv-mooncake-2proc``: a first process stores the prompts through the
  ``mooncake`` tier (cpu + mooncake, flushed) into a Mooncake pool on loopback
  (``lmkv.testing.mooncake``: a master and a holder lending one segment); a
  fresh second process measures (warm from the pool);
* ``lmkv-mooncake-client-2proc``: the same through a ``mooncake_client`` (the
  host's real client holds the pool; both vLLM processes are thin clients of
  it, ``client_address``, moving bytes through shared memory);
* ``lmkv-server``: server mode (``lmkv.mode: server``), an ``lmkv server`` with
  a cpu tier owns the KV, one vLLM process stores and loads through it;
* ``lmkv-server-2proc``: server mode, a first process stores the prompts into
  a fresh server; a fresh second process measures (warm from the server's
  shared-memory arena).

* ``lmkv-layerwise``: ``LMKVConnector`` with ``lmkv.layerwise: true``, cpu tier;
  one process, at 2048 and 4096 tokens, each warm prompt measured with
  whole-model loads (the per-layer path switched off) and layer-by-layer loads,
  alternating, median of ``max(--repeats, 5)``: TTFT of each, their ratio, the
  loader thread's time and the time the forward waited for layers (the part
  of the load the forward did not hide). Its own table, after the main one.

``--configs a,b`` runs a subset (``prefix-cache`` always runs: it is the baseline,
except in a run of ``lmkv-layerwise`` alone, whose table has its own);
``--repeats N`` takes the median of N (default 3). ``--rounds K`` (default 1)
runs the whole set K times, each round in fresh processes over fresh storage
(its own directory, its own server or pool), the configurations' order
reversed every other round, and pools each configuration's samples over the
rounds: a vLLM process keeps its forward's speed for its lifetime, faster or
slower than another process's by more than a connector's load (see
docs/benchmarks.md), so a comparison of two configurations across processes
needs several processes of each.

``--split`` picks where a warm prompt leaves the stored one:

* ``chunk`` (default): after exactly N tokens, a multiple of lmkv's chunk and of
  vLLM's block, so every configuration can hit the whole N;
* ``random``: after s tokens, s drawn uniformly from [N/2, N) by a RNG seeded
  with ``--seed`` (default 0), one s per length and repeat, the same in every
  configuration; the warm prompt is the first s tokens of the cold prompt plus
  N - s + 2-16 fresh ones (the same length as with ``chunk``). A cache hits at
  most s tokens, rounded down to its granularity: vLLM's block (128 tokens in
  the CPU build) for the prefix cache, lmkv's match granularity for lmkv.
  ExampleConnector only matches a whole stored prompt: it misses.

Hit tokens are vLLM's own count for the request (``RequestOutput.num_cached_tokens``:
prefix-cache hits plus the tokens a connector loaded), reported for every
configuration next to its warm TTFT, with the difference and the ratio to the
prefix cache's in the same run. ``--fs-page-cache true|false``,
``--fs-durable true|false`` and ``--fs-mapped-reads true|false`` set the fs
tier's ``page_cache``, ``durable`` and ``mapped_reads`` options in the
``lmkv-2proc`` configuration (default: the tier's defaults).
``BENCH_PREFAULT_AHEAD`` in the environment (a byte size, ``0``: off) sets
the cpu tier's ``prefault_ahead`` in every lmkv configuration.
``--timeline N`` prints, for each warm prompt of N tokens, when each connector
call began and how long it took, in ms from the request's start (``S.``: the
scheduler's connector, ``W.``: the worker's; in lmkv configurations also
``P.prefetch`` and ``P.fs_direct``: the lookup's work on lmkv's prefetch
thread, and the fs tier's call that opens the entries whose pages are cached
and hands the others to its I/O threads), to find where a warm request's time
goes across threads. Two lines give the CPU milliseconds of the process's
busiest threads (by name, from ``/proc``'s ``schedstat``) during each warm
and each cold sample: lmkv's background threads (the fs tier's
``lmkv-fs-write``, its I/O threads) beside vLLM's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

LENGTHS = (512, 2048, 4096)
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
ROUNDS = 1  # (--rounds: the main process only)
DTYPE = os.environ.get("BENCH_DTYPE", "float32")
SPLIT = os.environ.get("BENCH_SPLIT", "chunk")
SEED = int(os.environ.get("BENCH_SEED", "0"))
FS_PAGE_CACHE = os.environ.get("BENCH_FS_PAGE_CACHE", "")  # "": the tier's default
FS_DURABLE = os.environ.get("BENCH_FS_DURABLE", "")  # "": the tier's default
FS_MAPPED = os.environ.get("BENCH_FS_MAPPED_READS", "")  # "": the tier's default
CHUNK = 256
MAX_MODEL_LEN = 4608
CONFIGS = ("prefix-cache", "example-conn", "example-conn-2proc", "lmkv", "lmkv-2proc",
           "lmkv-mooncake-2proc", "lmkv-mooncake-client-2proc",
           "lmkv-server", "lmkv-server-2proc", "lmkv-layerwise")
LAYERWISE_LENGTHS = (2048, 4096)
SEPARATE = ("lmkv-layerwise",)  # configurations with their own table


def tokens(tag: str, n: int) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(10, 8000) for _ in range(n)]


def cold_prompt(length: int, i: int, kind: str = "base") -> list[int]:
    """``length`` fresh tokens plus 16 more (ExampleConnector keys a stored prompt
    by its tokens up to the last whole block before its last token)."""
    return tokens(f"{kind}-{length}-{i}", length) + tokens(f"pad-{kind}-{length}-{i}", 16)


def split_point(length: int, i: int) -> int:
    """How many leading tokens warm prompt ``i`` shares with cold prompt ``i``:
    ``length`` with ``--split chunk``; uniform in [length/2, length) with
    ``--split random``, from ``--seed`` alone (every configuration draws the same)."""
    if SPLIT == "chunk":
        return length
    return random.Random(f"split-{SEED}-{length}-{i}").randrange(length // 2, length)


def warm_prompt(length: int, i: int) -> list[int]:
    """The first ``split_point`` tokens of cold prompt ``i``, then new tokens up to
    ``length`` plus 2-16 (ExampleConnector looks up ``align(len - 1)`` tokens:
    one new token would miss)."""
    k = 2 + random.Random(f"k-{length}-{i}").randrange(15)
    s = split_point(length, i)
    return cold_prompt(length, i)[:s] + tokens(f"suffix-{length}-{i}", length - s + k)


def build(model_dir: str) -> int:
    import torch

    from lmkv.integrations.hf_model import build_model, build_tokenizer
    model = build_model(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                        head_dim=64, intermediate_size=2816, vocab_size=8192,
                        max_position_embeddings=MAX_MODEL_LEN, dtype=getattr(torch, DTYPE))
    model.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def make_llm(model_dir: str, mode: str, tmp: str):  # type: ignore[no-untyped-def]
    from vllm import LLM

    kwargs: dict = {}
    if mode.startswith("example-conn"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": os.path.join(tmp, "example")}}
    elif mode.startswith("lmkv"):
        # huge pages for the one-process engine that serves hits from memory; the
        # disk reader fills a fresh arena, where first touches of huge pages cost more
        tiers: list = [{"type": "cpu", "options": {
            "max_bytes": "2GiB", "huge_pages": mode in ("lmkv", "lmkv-layerwise")}}]
        if os.environ.get("BENCH_PREFAULT_AHEAD"):
            tiers[0]["options"]["prefault_ahead"] = os.environ["BENCH_PREFAULT_AHEAD"]
        if mode.startswith("lmkv-2proc"):
            fs: dict = {"url": os.path.join(tmp, "lmkv-fs")}
            if FS_PAGE_CACHE:
                fs["page_cache"] = FS_PAGE_CACHE == "true"
            if FS_DURABLE:
                fs["durable"] = FS_DURABLE == "true"
            if FS_MAPPED:
                fs["mapped_reads"] = FS_MAPPED == "true"
            tiers.append({"type": "fs", "options": fs})
        if mode.startswith("lmkv-mooncake"):
            tiers.append({"type": "mooncake", "options": json.loads(os.environ["BENCH_MOONCAKE"])})
        extra = {"lmkv.chunk_size": CHUNK, "lmkv.tiers": tiers}
        if mode == "lmkv-layerwise":
            extra["lmkv.layerwise"] = True
        if mode.startswith("lmkv-server"):
            extra = {"lmkv.chunk_size": CHUNK, "lmkv.mode": "server",
                     "lmkv.server.address": os.environ["BENCH_SERVER_ADDRESS"],
                     "lmkv.server.timeout_ms": 2000}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMKVConnector", "kv_connector_module_path": "lmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    return LLM(model=model_dir, enforce_eager=True, dtype=DTYPE,
               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=mode == "prefix-cache",
               max_num_seqs=4, seed=0, max_num_batched_tokens=MAX_MODEL_LEN, **kwargs)


def run(model_dir: str, mode: str, tmp: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model_dir, mode, tmp)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    worker = None
    if mode.startswith("lmkv"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        worker = get_kv_transfer_group().worker_side
    # ms in the connector's (synchronous) worker load / save and scheduler lookups
    spent = {"load": 0.0, "save": 0.0, "lookup": 0.0, "asks": 0.0}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def call(meta):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            fn(meta)
            spent[name] += (time.perf_counter() - t0) * 1e3
        return call

    def timed_lookup(fn):  # type: ignore[no-untyped-def]
        def call(request, num_computed):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = fn(request, num_computed)
            spent["lookup"] += (time.perf_counter() - t0) * 1e3
            spent["asks"] += 1
            return out
        return call

    if worker:
        for name in ("load", "save"):
            setattr(worker, name, timed(name, getattr(worker, name)))
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        sched.num_new_matched_tokens = timed_lookup(sched.num_new_matched_tokens)

    def ttft(p: list[int]) -> tuple[float, int | None]:
        """TTFT in ms and the tokens vLLM counts as cached (prefix cache or connector)."""
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3, out[0].num_cached_tokens

    timeline = _Timeline(llm, mode) if os.environ.get("BENCH_TIMELINE") else None
    ttft(tokens("warm-up", 64))  # one short unrelated request first
    if mode == "lmkv-layerwise":
        return run_layerwise(worker, ttft)
    if mode.endswith("-writer"):  # only stores the prompts the reader will extend
        for length in LENGTHS:
            for i in range(REPEATS):
                ttft(cold_prompt(length, i))
        storage = getattr(worker.engine, "storage", None) if worker else None  # none in server mode
        assert storage is None or storage.flush(120), "disk writes unfinished"
        return {"worker_counters": vars(worker.counters) if worker else {}}
    reader = mode.endswith("-reader")
    result: dict = {}
    for length in LENGTHS:
        cold, cold_threads = [], []
        for i in range(REPEATS):
            threads = _thread_cpu()
            cold.append(ttft(cold_prompt(length, i, "fresh" if reader else "base"))[0])
            cold_threads.append(_busiest(threads, _thread_cpu()))
        warm, hits, loaded, parts = [], [], [], []
        for i in range(REPEATS):
            before = worker.counters.loaded_tokens if worker else 0
            spent.update(dict.fromkeys(spent, 0.0))
            spent["cached"] = (_cached_share(tmp, "example" if mode.startswith("example")
                                             else "lmkv-fs") if reader else float("nan"))
            threads = _thread_cpu()
            if timeline is not None:
                timeline.start()
            with _profiled(mode, length, i):
                ms, cached = ttft(warm_prompt(length, i))
            if timeline is not None and str(length) == os.environ["BENCH_TIMELINE"]:
                spent["timeline"] = timeline.text()  # type: ignore[assignment]
            warm.append(ms)
            hits.append(cached)
            loaded.append(worker.counters.loaded_tokens - before if worker else None)
            parts.append({**spent, "threads": _busiest(threads, _thread_cpu())})
        result[str(length)] = {"cold": cold, "warm": warm, "hits": hits, "loaded": loaded,
                               "parts": parts, "cold_threads": cold_threads,
                               "split": [split_point(length, i) for i in range(REPEATS)]}
    if worker is not None:
        result["worker_counters"] = vars(worker.counters)
    return result


class _Timeline:
    """``--timeline``: each connector call (and lmkv's prefetch work) of a request,
    as ``name@start+duration`` in ms from ``start()``."""

    def __init__(self, llm, mode: str) -> None:  # type: ignore[no-untyped-def]
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        self.events: list[tuple[str, float, float]] = []
        self.t0 = 0.0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if scheduler is None:
            return
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished"):
            self._wrap(scheduler, name, "S." + name)
        worker = get_kv_transfer_group()
        for name in ("bind_connector_metadata", "start_load_kv", "wait_for_save",
                     "get_finished"):
            self._wrap(worker, name, "W." + name)
        if mode.startswith("lmkv"):
            from lmkv.storage.manager import StorageManager
            from lmkv_backends.tiers.fs import FSBackend
            self._wrap(StorageManager, "_prefetch", "P.prefetch")
            self._wrap(FSBackend, "batched_get_direct", "P.fs_direct")

    def _wrap(self, owner, name: str, label: str) -> None:  # type: ignore[no-untyped-def]
        fn = getattr(owner, name, None)
        if fn is None:
            return
        events = self.events

        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((label, t, time.perf_counter()))
        setattr(owner, name, call)

    def start(self) -> None:
        self.events.clear()
        self.t0 = time.perf_counter()

    def text(self) -> str:
        return " ".join(f"{n}@{(a - self.t0) * 1e3:.1f}+{(b - a) * 1e3:.1f}"
                        for n, a, b in sorted(self.events, key=lambda e: e[1]))


def _thread_cpu() -> dict[str, float]:
    """CPU ms each thread of this process has used so far (by ``name:tid``: a Python
    thread's name, else the kernel's, e.g. the OpenMP workers'; Linux ``/proc``;
    empty elsewhere): the scheduler's own count in ns (``schedstat``), or, on a
    kernel without it, ``stat``'s user and system time in clock ticks (usually
    10 ms)."""
    import threading
    named = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = 1e3 / os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        task = f"/proc/self/task/{tid}"
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"{task}/schedstat") as f:
                    ms = int(f.read().split()[0]) / 1e6  # on a CPU, ns
            except (FileNotFoundError, IndexError, ValueError):
                ms = 0.0
            if not ms:  # no schedstat, or a kernel that keeps it at 0
                with open(f"{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ms = (int(fields[11]) + int(fields[12])) * tick  # utime + stime
        except OSError:
            continue  # the thread ended
        out[f"{named.get(int(tid), name)}:{tid}"] = ms
    return out


def _busiest(before: dict[str, float], after: dict[str, float], top: int = 5) -> str:
    """The threads that used the most CPU between two ``_thread_cpu`` snapshots, as
    ``name ms`` (tids left out: threads of one name add up)."""
    used: dict[str, float] = {}
    for thread, ms in after.items():
        name = thread.rsplit(":", 1)[0].rstrip("0123456789").rstrip("_-")
        used[name] = used.get(name, 0.0) + ms - before.get(thread, 0.0)
    ranked = sorted(((ms, name) for name, ms in used.items() if ms > 0), reverse=True)
    return ", ".join(f"{name} {ms:.0f}" for ms, name in ranked[:top])


def _cached_share(tmp: str, folder: str) -> float:
    """The share of the bytes of the files under ``tmp/folder`` (lmkv's fs tier,
    ``lmkv-fs``, or ExampleConnector's, ``example``) in the page cache now (Linux
    6.5+ ``cachestat``; NaN where the kernel cannot tell): this kernel reclaims idle
    files' pages a minute or so after they were written, and a load from the disk
    is another load."""
    from lmkv_backends.tiers.fs_local import _PAGE, _pages_cached_count
    total = cached = 0
    for root, _, files in os.walk(os.path.join(tmp, folder)):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                pages = _pages_cached_count(fd, size)
            finally:
                os.close(fd)
            if pages is None:
                return float("nan")
            total += size
            cached += min(size, pages * _PAGE)
    return cached / total if total else float("nan")


@contextlib.contextmanager
def _profiled(mode: str, length: int, i: int) -> Iterator[None]:
    """With ``--profile DIR``: cProfile of the warm request (``DIR/MODE-LENGTH-I.pstats``;
    ``python -m pstats`` reads it)."""
    where = os.environ.get("BENCH_PROFILE")
    if not where:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        os.makedirs(where, exist_ok=True)
        profile.dump_stats(os.path.join(where, f"{mode}-{length}-{i}.pstats"))


def run_layerwise(worker, ttft) -> dict:  # type: ignore[no-untyped-def]
    """Whole-model against layer-by-layer loads of the same warm prompts in one
    process. ``worker.layered`` set to None is the whole-model path (the worker
    loads in ``start_load_kv`` and the forward never waits per layer); restored,
    the layerwise one. Each repeat runs both, in alternating order."""
    layered = worker.layered
    spent = {"loader": 0.0, "waited": 0.0}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += (time.perf_counter() - t0) * 1e3
        return call

    worker._load_layered = timed("loader", worker._load_layered)
    worker.wait_layer = timed("waited", worker.wait_layer)
    load = worker.load

    def whole_load(meta):  # type: ignore[no-untyped-def]  # the load in start_load_kv
        t0 = time.perf_counter()
        load(meta)
        spent["loader"] += (time.perf_counter() - t0) * 1e3
        spent["waited"] += (time.perf_counter() - t0) * 1e3  # the forward waits it all
    repeats = max(REPEATS, 5)
    result: dict = {}
    for length in LAYERWISE_LENGTHS:
        cold = [ttft(cold_prompt(length, i))[0] for i in range(repeats)]
        rows: dict = {v: {"warm": [], "loaded": [], "loader": [], "waited": []}
                      for v in ("whole", "layerwise")}
        for i in range(repeats):
            order = ("whole", "layerwise") if i % 2 == 0 else ("layerwise", "whole")
            for variant in order:
                worker.layered = layered if variant == "layerwise" else None
                worker.load = load if variant == "layerwise" else whole_load
                spent.update(dict.fromkeys(spent, 0.0))
                before = worker.counters.loaded_tokens
                ms, _ = ttft(warm_prompt(length, i))
                row = rows[variant]
                row["warm"].append(ms)
                row["loaded"].append(worker.counters.loaded_tokens - before)
                row["loader"].append(spent["loader"])
                row["waited"].append(spent["waited"])
        result[str(length)] = {"cold": cold, **rows}
    worker.layered, worker.load = layered, load
    result["worker_counters"] = vars(worker.counters)
    return result


def report_layerwise(r: dict) -> bool:
    """The layerwise table; False when a warm prompt did not load its prefix."""
    med = statistics.median
    print(f"\nlmkv.layerwise, one process: whole-model loads (in start_load_kv) vs "
          f"layer-by-layer loads of the same warm prompts, median of "
          f"{len(r[str(LAYERWISE_LENGTHS[0])]['cold'])} each, alternating")
    print("load ms = the load's own time (whole: in start_load_kv; layerwise: the loader "
          "thread); waited ms = what the forward waited for KV; hidden = 1 - waited/load; "
          "saved = (whole - layerwise TTFT) / whole load: the share of the whole-model load "
          "the pipelining took off TTFT")
    print(f"{'tokens':>7}{'cold':>9}{'whole':>9}{'layerw.':>9}{'lw/whole':>9}{'Δ ms':>8}"
          f"{'load w':>8}{'load lw':>8}{'waited':>8}{'hidden':>8}{'saved':>8}")
    ok = True
    for n in LAYERWISE_LENGTHS:
        x = r[str(n)]
        whole, lw = med(x["whole"]["warm"]), med(x["layerwise"]["warm"])
        load_lw, waited = med(x["layerwise"]["loader"]), med(x["layerwise"]["waited"])
        hidden = 1 - waited / load_lw if load_lw else float("nan")
        print(f"{n:>7}{med(x['cold']):>9.1f}{whole:>9.1f}{lw:>9.1f}{lw / whole:>9.3f}"
              f"{lw - whole:>+8.1f}{med(x['whole']['loader']):>8.1f}{load_lw:>8.1f}"
              f"{waited:>8.1f}{hidden:>8.0%}{(whole - lw) / med(x['whole']['loader']):>8.0%}")
        for v in ("whole", "layerwise"):
            if any(t != n for t in x[v]["loaded"]):
                print(f"  WARNING ({v}, {n}): a warm prompt did not load its {n}-token prefix: "
                      f"{x[v]['loaded']}")
                ok = False
    print("samples (ms):", {n: {v: [round(t, 1) for t in r[str(n)][v]["warm"]]
                                for v in ("whole", "layerwise")} for n in LAYERWISE_LENGTHS})
    print("lmkv-layerwise worker counters:", r["worker_counters"])
    return ok


def sub(mode: str, model_dir: str, tmp: str, env: dict) -> dict:
    out = os.path.join(tmp, f"{mode}.json")
    t0 = time.perf_counter()
    with open(out + ".log", "w") as log:
        rc = subprocess.call([sys.executable, __file__, "--run", mode, model_dir, tmp, out],
                             env=env, stdout=subprocess.DEVNULL, stderr=log)
    if rc != 0:
        with open(out + ".log") as f:
            sys.stderr.write(f.read()[-4000:])
        raise SystemExit(f"the {mode} run exited {rc}")
    print(f"  {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--split", choices=("chunk", "random"), default="chunk",
                        help="where warm prompts leave the stored one (see the docstring)")
    parser.add_argument("--seed", type=int, default=0, help="the --split random RNG's seed")
    parser.add_argument("--fs-page-cache", choices=("true", "false"), default="",
                        help="the fs tier's page_cache option in lmkv-2proc")
    parser.add_argument("--fs-durable", choices=("true", "false"), default="",
                        help="the fs tier's durable option in lmkv-2proc")
    parser.add_argument("--fs-mapped-reads", choices=("true", "false"), default="",
                        help="the fs tier's mapped_reads option in lmkv-2proc")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole set this many times in fresh processes, "
                             "alternating the order, and pool the samples")
    parser.add_argument("--timeline", type=int, choices=LENGTHS, metavar="N",
                        help="print each warm prompt's connector calls at N tokens "
                             "(see the docstring)")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="cProfile each warm request into DIR (timings then include "
                             "the profiler's cost: find where time goes, do not compare)")
    args = parser.parse_args()
    asked = [c for c in args.configs.split(",") if c != "prefix-cache"]
    # prefix-cache is the main table's baseline; a run of separate tables only skips it
    configs = asked if asked and set(asked) <= set(SEPARATE) else ["prefix-cache", *asked]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    global REPEATS, DTYPE, SPLIT, SEED, ROUNDS
    REPEATS, DTYPE, SPLIT, SEED = args.repeats, args.dtype, args.split, args.seed
    ROUNDS = args.rounds
    os.environ.update(BENCH_REPEATS=str(REPEATS), BENCH_DTYPE=DTYPE, BENCH_SPLIT=SPLIT,
                      BENCH_SEED=str(SEED), BENCH_FS_PAGE_CACHE=args.fs_page_cache,
                      BENCH_FS_DURABLE=args.fs_durable,
                      BENCH_FS_MAPPED_READS=args.fs_mapped_reads,
                      BENCH_TIMELINE=str(args.timeline or ""),
                      BENCH_PROFILE=os.path.abspath(args.profile) if args.profile else "")
    cpus = f"0-{(os.cpu_count() or 1) - 1}"  # every configuration gets every CPU
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t_start = time.perf_counter()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-vllm-") as top:
        model_dir = os.path.join(top, "model")
        print(f"model: {build(model_dir) / 1e6:.0f}M parameters, {DTYPE}", flush=True)
        results: dict = {}
        per_round: dict = {}  # each round's warm median, per configuration and length
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}: {', '.join(order)}", flush=True)
            tmp = os.path.join(top, f"round-{r}")
            os.makedirs(tmp)
            for mode, got in run_round(order, model_dir, tmp, env).items():
                results[mode] = pool_rounds(results[mode], got) if mode in results else got
                for n in LENGTHS:
                    if "warm" in got.get(str(n), {}):  # (lmkv-layerwise's are its own)
                        per_round.setdefault(mode, {}).setdefault(n, []).append(
                            round(statistics.median(got[str(n)]["warm"]), 1))
            shutil.rmtree(tmp, ignore_errors=True)
    results = {m: results[m] for m in configs}
    separate = {m: results.pop(m) for m in SEPARATE if m in results}
    ok = report(results, [c for c in configs if c not in SEPARATE]) if results else True
    if "lmkv-layerwise" in separate:
        ok = report_layerwise(separate["lmkv-layerwise"]) and ok
    if args.rounds > 1:
        print("warm median of each round (ms; each round's processes are fresh):", per_round)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


def pool_rounds(before: Any, more: Any) -> Any:
    """One configuration's results of two rounds as one: every list of samples
    one after the other, at any depth (lmkv-layerwise's too), counters added
    up; anything else as the later round has it."""
    if isinstance(before, list) and isinstance(more, list):
        return before + more
    if isinstance(before, dict) and isinstance(more, dict):
        return {**before, **{k: pool_rounds(before[k], v) if k in before else v
                             for k, v in more.items()}}
    if (isinstance(before, int | float) and isinstance(more, int | float)
            and not isinstance(before, bool)):
        return before + more
    return more


def run_round(configs: list[str], model_dir: str, tmp: str, env: dict) -> dict:
    """Each configuration once, in its own subprocesses, storing under ``tmp``."""
    from lmkv.testing.server import spawn_server
    results = {}
    for mode in configs:
        server = pool = None
        if mode.startswith("lmkv-mooncake"):
            from lmkv.testing.mooncake import MooncakePool
            if not MooncakePool.available():
                raise SystemExit("lmkv-mooncake-2proc needs lmkv-mooncake[cpu] in this venv")
            real_client = mode.startswith("lmkv-mooncake-client")
            pool = MooncakePool(tmp, segment_bytes=4 << 30, real_client=real_client)
            env["BENCH_MOONCAKE"] = json.dumps({
                **pool.options, "local_buffer_size": "256MiB" if real_client else "1GiB"})
        if mode.startswith("lmkv-server"):
            server, env["BENCH_SERVER_ADDRESS"] = spawn_server(
                tmp, "tiers:\n  - type: cpu\n    options: {max_bytes: 4GiB}\n", env=env)
        try:
            if mode.endswith("-2proc"):
                writer = sub(f"{mode}-writer", model_dir, tmp, env)
                print("    writer counters:", writer["worker_counters"], flush=True)
                results[mode] = sub(f"{mode}-reader", model_dir, tmp, env)
            else:
                results[mode] = sub(mode, model_dir, tmp, env)
        finally:
            if pool is not None:
                pool.close()
            if server is not None:
                server.terminate()
                server.wait(60)
    return results


def report(results: dict, configs: list[str]) -> bool:
    """Print the table and the targets; False when a chunk-split warm prompt missed."""
    med = {m: {n: {k: statistics.median(r[str(n)][k]) for k in ("cold", "warm", "hits")}
               for n in LENGTHS} for m, r in results.items()}
    pc = med["prefix-cache"]
    how = ("N + 2-16" if SPLIT == "chunk" else
           "the first s tokens of a cold prompt, s uniform in [N/2, N), then fresh tokens "
           "up to N + 2-16")
    rounds = f" ({ROUNDS} rounds of {REPEATS})" if ROUNDS > 1 else ""
    print(f"\nTTFT, median of {REPEATS * ROUNDS}{rounds} (ms); cold = N + 16 tokens, warm = {how}; "
          f"--split {SPLIT}" + (f" --seed {SEED}" if SPLIT == "random" else ""))
    if SPLIT == "random":
        print("split points s:", {n: results["prefix-cache"][str(n)]["split"] for n in LENGTHS})
    print("hits = tokens vLLM counted as cached per warm prompt (median); Δ and x are "
          "against prefix-cache, same run")
    print(f"{'config':<20}{'tokens':>7}{'cold':>9}{'warm':>9}{'warm/cold':>10}{'Δpc ms':>8}"
          f"{'x pc':>7}{'hits':>7}{'Δhits':>7}"
          f"  lmkv (median ms): lookup (asks) / load / save; loaded tokens per warm")
    for m, r in results.items():
        for n in LENGTHS:
            row, base = med[m][n], pc[n]
            loaded = r[str(n)]["loaded"]
            part = {k: statistics.median(p[k] for p in r[str(n)]["parts"])
                    for k, v in r[str(n)]["parts"][0].items() if isinstance(v, float)}
            note = "" if loaded[0] is None else (
                f"{part['lookup']:.1f} ({part['asks']:.0f}) / {part['load']:.1f} / "
                f"{part['save']:.1f}  {loaded}")
            print(f"{m:<20}{n:>7}{row['cold']:>9.1f}{row['warm']:>9.1f}"
                  f"{row['warm'] / row['cold']:>10.3f}{row['warm'] - base['warm']:>+8.1f}"
                  f"{row['warm'] / base['warm']:>7.2f}{row['hits']:>7.0f}"
                  f"{row['hits'] - base['hits']:>+7.0f}  {note}")
    ok = True
    for m in (c for c in configs if c != "prefix-cache"):
        if m.startswith("lmkv"):
            print(f"{m} worker counters: {results[m]['worker_counters']}")
        for n in LENGTHS:
            got = results[m][str(n)]
            if SPLIT == "chunk" and any(x is not None and x != n for x in got["loaded"]):
                print(f"  WARNING ({m}, {n}): a warm prompt did not load its {n}-token prefix")
                ok = False
            short = [(h, p) for h, p in zip(got["hits"], results["prefix-cache"][str(n)]["hits"],
                                            strict=True) if h < p]
            if short and m.startswith("lmkv"):
                print(f"  target missed ({m}, {n}): hit fewer tokens than the prefix cache "
                      f"(hits, prefix cache's): {short}")
            if not m.startswith("lmkv"):
                continue
            if m == "lmkv-2proc":  # from disk: at most ExampleConnector's (across processes)
                ec = next((c for c in ("example-conn-2proc", "example-conn") if c in med), None)
                if ec and med[m][n]["warm"] > med[ec][n]["warm"]:
                    print(f"  target missed ({m}, {n}): warm {med[m][n]['warm']:.1f} ms over "
                          f"{ec}'s {med[ec][n]['warm']:.1f}")
            elif m.startswith("lmkv-mooncake"):  # from the pool: within 10 ms at 512 / 2048
                gap = med[m][n]["warm"] - pc[n]["warm"]
                if n in (512, 2048) and gap > 10:
                    print(f"  target missed ({m}, {n}): warm is {gap:.1f} ms over the prefix "
                          "cache's (target: within 10 ms)")
            elif (gap := med[m][n]["warm"] - pc[n]["warm"]) > 2:
                print(f"  target missed ({m}, {n}): warm is {gap:.1f} ms over the prefix cache's")
    print("warm samples (ms):", {m: {n: [round(x, 1) for x in r[str(n)]["warm"]]
                                     for n in LENGTHS} for m, r in results.items()})
    print("lmkv per warm sample (lookup ms / asks / load ms):",
          {m: {n: [f"{p['lookup']:.1f}/{p['asks']:.0f}/{p['load']:.1f}"
                   for p in r[str(n)]["parts"]] for n in LENGTHS}
           for m, r in results.items() if m.startswith("lmkv")})
    print("CPU ms of the process's busiest threads during each warm sample (by name):",
          {m: {n: [p.get("threads", "") for p in r[str(n)]["parts"]] for n in LENGTHS}
           for m, r in results.items()})
    print("CPU ms of the process's busiest threads during each cold sample (by name):",
          {m: {n: r[str(n)].get("cold_threads", []) for n in LENGTHS}
           for m, r in results.items()})
    print("share of the stored files in the page cache before each warm sample:",
          {m: {n: [round(p["cached"], 2) for p in r[str(n)]["parts"]] for n in LENGTHS}
           for m, r in results.items() if m.endswith("-2proc")})
    if os.environ.get("BENCH_TIMELINE"):
        n = os.environ["BENCH_TIMELINE"]
        for m, r in results.items():
            for i, p in enumerate(r[n]["parts"]):
                print(f"timeline {m} {n} #{i}: {p.get('timeline', '')}")
    print("hit tokens per warm prompt:", {m: {n: r[str(n)]["hits"] for n in LENGTHS}
                                          for m, r in results.items()})
    return ok


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--run":  # one configuration's subprocess
        res = run(sys.argv[3], sys.argv[2], sys.argv[4])
        with open(sys.argv[5], "w") as f:
            json.dump(res, f)
        sys.exit(0)
    sys.exit(main())
