"""Per-step overhead of ``LMKVConnector`` in a real vLLM (CPU build): eager vs lazy offload.

Run with the vLLM venv: ``.venv-vllm/bin/python benchmarks/bench_vllm_sched.py``
(1-2 minutes on 2 cores; ``--requests N`` changes the workload size).

A tiny random-weight Llama (2 layers, hidden 256, head_dim 64, float32) so a
step is short and the connector's share of it shows. Each configuration runs in
its own subprocess, in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
vLLM prefix caching on in all three (lazy offload needs it):

* ``none``: no connector (baseline for vLLM's own scheduler time per step);
* ``eager``: ``LMKVConnector``, cpu tier, eager store (the default);
* ``lazy``: the same with ``lmkv.lazy_offload`` (FIFO, ``LAZY_THRESHOLD``,
  ``LAZY_SELECT_COUNT``).

Workload: ``REQUESTS`` prompts of 600-1100 random tokens (distinct, so every
whole 256-token chunk is a store and no lookup hits), ``MAX_TOKENS`` decode
tokens each, all in one ``llm.generate`` call so steps batch several requests;
then a "flush" phase (a few short prompts, no stores of their own) gives lazy
offload steps with scheduled tokens to submit what finished requests left.

The connector class is ``TimedLMKVConnector`` from this file (loaded through
``kv_connector_module_path``): it wraps each hook with ``perf_counter_ns``.
A scheduler-side step is one ``build_connector_meta`` call; it is charged the
hooks called since the previous one (``get_num_new_matched_tokens`` and
``update_state_after_alloc`` of this step's ``schedule()``, and
``update_connector_output`` / ``request_finished`` of the previous step's
output). A worker-side step is one ``wait_for_save``, charged with the
``start_load_kv`` before it. Parts inside the hooks (lookup hashing, sending
and polling; the store's hashing, allocation, copy and put; lazy offload's
buffering and selection) are timed by wrapping those objects' methods on the
main thread. Timings are printed, never asserted; on a shared machine a
preempted step shows up in p99 / max, so read p50 beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

CHUNK = 256
REQUESTS = 96
PROMPT_LEN = (600, 1100)
MAX_TOKENS = 4
MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
LAZY_THRESHOLD = 8
LAZY_SELECT_COUNT = 4
CONFIGS = ("none", "eager", "lazy")
SCHED_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
               "build_connector_meta", "update_connector_output", "request_finished")
WORKER_HOOKS = ("start_load_kv", "wait_for_save")
POLL = "lookup: poll (waits up to backoff_ms for the answer)"
COPY = "store: copy out of the paged cache"
NOT_KNOWN = "lookup: answered not known yet"

# -- the timed connector (imported by vLLM as ``bench_vllm_sched``) -------------------

#: role name ("SCHEDULER" / "WORKER") -> the connector vLLM built for it (in-process).
REGISTRY: dict[str, Any] = {}
_main_thread = threading.main_thread()


class StepClock:
    """Nanoseconds per hook, summed into the open step until ``close``; ``note``
    records a part inside a hook (per step, not added to the step's total)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.open = 0
        self.open_parts: dict[str, int] = defaultdict(int)
        self.steps: list[int] = []
        self.info: list[dict[str, int]] = []
        self.hooks: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # ns, calls

    def add(self, hook: str, ns: int) -> None:
        self.open += ns
        self.open_parts[hook] += ns
        entry = self.hooks[hook]
        entry[0] += ns
        entry[1] += 1

    def note(self, part: str, ns: int) -> None:
        self.open_parts[part] += ns
        self.open_parts[part + " calls"] += 1

    def close(self, **info: int) -> None:
        self.steps.append(self.open)
        self.info.append({**self.open_parts, **info})
        self.open = 0
        self.open_parts = defaultdict(int)

    def fold_open(self) -> None:
        """Charge what came after the last step (its output's hooks) to that step."""
        if self.steps:
            self.steps[-1] += self.open
            for k, v in self.open_parts.items():
                self.info[-1][k] = self.info[-1].get(k, 0) + v
        self.open = 0
        self.open_parts = defaultdict(int)

    def dump(self) -> dict[str, Any]:
        return {"steps": self.steps, "info": self.info, "hooks": dict(self.hooks)}


def _make_timed_connector() -> type:
    from lmkv.integrations.vllm.connector import LMKVConnector

    ns = time.perf_counter_ns

    class TimedLMKVConnector(LMKVConnector):
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self.clock = StepClock()
            REGISTRY.setdefault(role.name, self)

        # scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> Any:
            t0 = ns()
            result = super().get_num_new_matched_tokens(request, num_computed)
            self.clock.add("get_num_new_matched_tokens", ns() - t0)
            if result[0] is None:
                self.clock.note(NOT_KNOWN, 0)
            return result

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
            t0 = ns()
            try:
                super().update_state_after_alloc(request, blocks, num_external)
            finally:
                self.clock.add("update_state_after_alloc", ns() - t0)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            t0 = ns()
            meta = super().build_connector_meta(scheduler_output)
            self.clock.add("build_connector_meta", ns() - t0)
            lazy = self.scheduler_side.lazy
            self.clock.close(
                scheduled=scheduler_output.total_num_scheduled_tokens,
                stores=len(meta.stores),
                store_tokens=sum(len(s.token_ids) for s in meta.stores),
                pending=len(lazy.policy) if lazy is not None else 0)
            return meta

        def update_connector_output(self, connector_output: Any) -> None:
            t0 = ns()
            try:
                super().update_connector_output(connector_output)
            finally:
                self.clock.add("update_connector_output", ns() - t0)

        def request_finished(self, request: Any, block_ids: list[int]) -> Any:
            t0 = ns()
            try:
                return super().request_finished(request, block_ids)
            finally:
                self.clock.add("request_finished", ns() - t0)

        # worker side
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            t0 = ns()
            try:
                super().start_load_kv(forward_context, **kwargs)
            finally:
                self.clock.add("start_load_kv", ns() - t0)

        def wait_for_save(self) -> None:
            counters = self.worker_side.counters
            before = counters.stored_tokens
            specs = len(getattr(self._get_connector_metadata(), "stores", ()))
            t0 = ns()
            try:
                super().wait_for_save()
            finally:
                self.clock.add("wait_for_save", ns() - t0)
                self.clock.close(stores=specs, stored=counters.stored_tokens - before)

    return TimedLMKVConnector


def __getattr__(name: str) -> Any:  # vLLM asks for the class only in the child process
    if name == "TimedLMKVConnector":
        cls = globals()["TimedLMKVConnector"] = _make_timed_connector()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _wrap(obj: Any, attr: str, totals: dict[str, list[int]], key: str,
          clock: StepClock | None = None) -> None:
    """Time ``obj.attr`` calls made on the main thread into ``totals[key]`` (and
    into ``clock``'s open step)."""
    fn = getattr(obj, attr)
    ns = time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not _main_thread:
            return fn(*args, **kwargs)
        t0 = ns()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = ns() - t0
            entry = totals[key]
            entry[0] += dt
            entry[1] += 1
            if clock is not None:
                clock.note(key, dt)

    setattr(obj, attr, timed)


# -- one configuration (child process) ---------------------------------------------

def prompts(n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        rng = random.Random(f"sched-{i}")
        out.append([rng.randrange(10, 8000) for _ in range(rng.randint(*PROMPT_LEN))])
    return out


def run(mode: str, model_dir: str, n_requests: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.modules.setdefault("bench_vllm_sched", sys.modules[__name__])
    kwargs: dict = {}
    if mode != "none":
        extra: dict = {"lmkv.chunk_size": CHUNK,
                       "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "1GiB"}}]}
        if mode == "lazy":
            extra.update({"lmkv.lazy_offload": True,
                          "lmkv.lazy_offload_threshold": LAZY_THRESHOLD,
                          "lmkv.lazy_offload_select_count": LAZY_SELECT_COUNT})
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TimedLMKVConnector", "kv_connector_module_path": "bench_vllm_sched",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
              enable_prefix_caching=True, max_num_seqs=MAX_NUM_SEQS, seed=0,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    # vLLM's own scheduler time per step (it includes the connector's scheduler hooks)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    vllm_steps: dict[str, list[int]] = {"schedule": [], "update": []}

    def timed_step(name: str) -> None:
        fn = getattr(scheduler, name)

        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter_ns()
            result = fn(*args, **kw)
            vllm_steps["schedule" if name == "schedule" else "update"].append(
                time.perf_counter_ns() - t0)
            return result

        setattr(scheduler, name, call)

    timed_step("schedule")
    timed_step("update_from_output")

    sched = REGISTRY.get("SCHEDULER")
    worker = REGISTRY.get("WORKER")
    parts: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # inside the hooks
    if worker is not None:
        engine, clock = worker.worker_side.engine, worker.clock
        _wrap(engine.chunker, "chunk", parts, "store: hash chunks")
        _wrap(engine.storage, "pin_prefix", parts, "store: pin stored prefix")
        _wrap(engine.storage, "allocate", parts, "store: allocate")
        _wrap(engine.connector, "to_chunks", parts, COPY, clock)
        _wrap(engine.storage, "put", parts, "store: put")
        _wrap(engine.storage, "unpin", parts, "store: unpin")
    if sched is not None:
        import lmkv.lookup.client as client_module

        side, clock = sched.scheduler_side, sched.clock
        _wrap(client_module, "prefix_hashes", parts, "lookup: hash prompt")
        _wrap(side.client, "_send_locked", parts, "lookup: send to workers")
        _wrap(side.client, "lookup", parts, "lookup: all of lookup()")
        _wrap(side.client, "poll", parts, POLL, clock)
        if side.lazy is not None:
            _wrap(side.lazy, "add", parts, "lazy: add (buffer + snapshot)")
            _wrap(side.lazy, "select", parts, "lazy: select (verify + touch)", clock)
            _wrap(side.lazy, "confirmed", parts, "lazy: confirmed (free blocks)")

    def generate(ps: list[list[int]], sampling: Any = params) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sampling, use_tqdm=False)
        return time.perf_counter() - t0

    def reset() -> None:
        for conn in (sched, worker):
            if conn is not None:
                conn.clock.reset()
        for v in vllm_steps.values():
            v.clear()
        parts.clear()

    def snapshot(wall: float) -> dict:
        phase: dict = {"wall_s": wall, "vllm": {k: list(v) for k, v in vllm_steps.items()},
                       "parts": {k: list(v) for k, v in parts.items()}}
        if sched is not None:
            sched.clock.fold_open()
            side = sched.scheduler_side
            phase["sched"] = sched.clock.dump()
            phase["sched_counters"] = {k: v for k, v in vars(side.counters).items()
                                       if k != "extra"}
            lazy = side.lazy
            if lazy is not None:
                # buffered, not yet submitted (FIFO's private table; empty if it moves)
                items = getattr(lazy.policy, "_items", {}).values()
                phase["lazy"] = {
                    "pending": len(lazy.policy), "ready": lazy.policy.ready_count,
                    "pending_tokens": sum(max(len(m.token_ids) for m in it.metas)
                                          for it in items if it.metas),
                    "protected": lazy.protected_stores, "skipped": lazy.skipped}
        if worker is not None:
            phase["worker"] = worker.clock.dump()
            phase["worker_counters"] = dict(vars(worker.worker_side.counters))
        return phase

    warm = [[random.Random(f"warm-{i}").randrange(10, 8000) for _ in range(200)]
            for i in range(4)]  # under one chunk: no lookups, no stores
    generate(warm)
    reset()
    workload = prompts(n_requests)
    load = os.getloadavg()[0]
    result = {"main": snapshot(generate(workload))}
    result["load"] = [load, os.getloadavg()[0]]  # other jobs on the machine
    reset()
    # steps with scheduled tokens and no stores of their own: lazy submits what it holds
    fillers = [[random.Random(f"fill-{i}").randrange(10, 8000) for _ in range(64)]
               for i in range(2)]
    flush = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    result["flush"] = snapshot(generate(fillers, flush))
    result["expected_store_tokens"] = sum(len(p) // CHUNK * CHUNK for p in workload)
    result["prompt_tokens"] = sum(len(p) for p in workload)
    return result


# -- the parent: build the model, run each configuration, print ----------------------

def build(model_dir: str) -> int:
    import torch

    from lmkv.integrations.hf_model import build_model, build_tokenizer
    model = build_model(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=64, intermediate_size=512, vocab_size=8192,
                        max_position_embeddings=MAX_MODEL_LEN, dtype=torch.float32)
    model.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def sub(mode: str, model_dir: str, tmp: str, n_requests: int) -> dict:
    out = os.path.join(tmp, f"{mode}.json")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0,1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(out + ".log", "w") as log:
        rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--run", mode,
                              model_dir, out, str(n_requests)],
                             env=env, stdout=subprocess.DEVNULL, stderr=log)
    if rc != 0:
        with open(out + ".log") as f:
            sys.stderr.write(f.read()[-4000:])
        raise SystemExit(f"the {mode} run exited {rc}")
    print(f"  {mode}: {time.perf_counter() - t0:.0f} s (process, vLLM start included)",
          flush=True)
    with open(out) as f:
        return json.load(f)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


def summary(ns: list[int]) -> dict[str, float]:
    """mean / p50 / p99 / max in µs of per-step nanoseconds."""
    us = [x / 1e3 for x in ns]
    if not us:
        return dict.fromkeys(("mean", "p50", "p99", "max"), float("nan"))
    return {"mean": statistics.fmean(us), "p50": pct(us, 0.5), "p99": pct(us, 0.99),
            "max": max(us)}


def _row(st: dict[str, float] | None, keys: tuple[str, ...] = ("mean", "p50", "p99", "max"),
         width: int = 8) -> str:
    if st is None:
        return "".join(f"{'-':>{width}}" for _ in keys)
    return "".join(f"{st[k]:>{width}.0f}" for k in keys)


def _ratio(a: dict[str, float], b: dict[str, float],
           keys: tuple[str, ...] = ("mean", "p50", "p99", "max"), width: int = 8) -> str:
    return "".join(f"{a[k] / b[k] if b[k] else float('nan'):>{width}.2f}" for k in keys)


def report(results: dict[str, dict]) -> None:
    rows: dict[str, dict[str, Any]] = {}
    for mode, r in results.items():
        m = r["main"]
        v = m["vllm"]
        row: dict[str, Any] = {
            "steps": len(v["schedule"]), "wall": m["wall_s"], "load": r["load"],
            "vllm": summary([a + b for a, b in zip(v["schedule"], v["update"], strict=True)]),
            "sched": None, "excl": None, "worker": None}
        if "sched" in m:
            steps, info = m["sched"]["steps"], m["sched"]["info"]
            row["sched"] = summary(steps)
            row["excl"] = summary([t - i.get("get_num_new_matched_tokens", 0)
                                   for t, i in zip(steps, info, strict=True)])
            row["polls"] = sum(i.get(POLL + " calls", 0) for i in info)
            row["unknown"] = sum(i.get(NOT_KNOWN + " calls", 0) for i in info)
            w_steps, w_info = m["worker"]["steps"], m["worker"]["info"]
            row["worker"] = summary(w_steps)
            on = [t for t, i in zip(w_steps, w_info, strict=True) if i["stores"]]
            row["store_steps"] = (len(on), summary(on)["mean"])
        rows[mode] = row

    print("\nScheduler side, µs per step (main phase). conn = the connector's scheduler hooks "
          "per build_connector_meta;\n'excl. lookup' leaves out get_num_new_matched_tokens "
          "(lookup round trips: the same work eager or lazy);\nvLLM = schedule() + "
          "update_from_output(), connector hooks included.")
    print(f"{'config':<7}{'steps':>6} |{'conn mean':>10}{'p50':>8}{'p99':>8}{'max':>8} |"
          f"{'excl.lookup mean':>17}{'p50':>8}{'p99':>8}{'max':>8} |{'polls':>6}"
          f"{'unknown':>8} |{'vLLM mean':>10}{'p99':>8}")
    for mode, row in rows.items():
        polls = f"{row.get('polls', '-'):>6}{row.get('unknown', '-'):>8}"
        print(f"{mode:<7}{row['steps']:>6} |  {_row(row['sched'])} |         "
              f"{_row(row['excl'])} |{polls} |  {_row(row['vllm'], ('mean', 'p99'))}")
    e, la, base = rows.get("eager"), rows.get("lazy"), rows["none"]
    if e and la:
        print(f"{'lazy/eager':<13} |  {_ratio(la['sched'], e['sched'])} |         "
              f"{_ratio(la['excl'], e['excl'])} |{'':>14} |  "
              f"{_ratio(la['vllm'], e['vllm'], ('mean', 'p99'))}")
    for mode in ("eager", "lazy"):
        if mode in rows:
            print(f"{mode + '/none':<13} |{'':>34} |{'':>41} |{'':>14} |  "
                  f"{_ratio(rows[mode]['vllm'], base['vllm'], ('mean', 'p99'))}")

    print("\nWorker side, µs per step (start_load_kv + wait_for_save per wait_for_save), and "
          "the wall time of the generate call:")
    print(f"{'config':<7}{'steps':>6} |{'worker mean':>12}{'p50':>8}{'p99':>8}{'max':>8} |"
          f"{'steps w/ stores':>16}{'their mean':>11} |{'generate s':>11}{'vs none':>8}"
          f" | load avg")
    for mode, row in rows.items():
        n, mean = row.get("store_steps", ("-", float("nan")))
        print(f"{mode:<7}{row['steps']:>6} |    {_row(row['worker'])} |{n:>16}{mean:>11.0f} |"
              f"{row['wall']:>11.2f}{row['wall'] / base['wall']:>8.2f} | "
              f"{row['load'][0]:.1f} -> {row['load'][1]:.1f}")
    if e and la:
        print(f"{'lazy/eager':<13} |    {_ratio(la['worker'], e['worker'])} |"
              f"{'':>27} |{la['wall'] / e['wall']:>11.2f}")

    for mode in ("eager", "lazy"):
        if mode not in results:
            continue
        r = results[mode]
        m, fl = r["main"], r["flush"]
        print(f"\n{mode}: time by hook, then by part inside the hooks (main phase; ms, calls)")
        hooks = {**m["sched"]["hooks"], **m["worker"]["hooks"]}
        print("  " + "; ".join(f"{k} {hooks[k][0] / 1e6:.1f} ({hooks[k][1]})"
                               for k in (*SCHED_HOOKS, *WORKER_HOOKS) if k in hooks))
        print("  " + "; ".join(f"{k} {v[0] / 1e6:.1f} ({v[1]})"
                               for k, v in sorted(m["parts"].items())))
        planned = m["sched_counters"]["store_tokens"]
        stored = m["worker_counters"]["stored_tokens"]
        flushed = fl["worker_counters"]["stored_tokens"] - stored
        specs = sum(i["stores"] for i in m["worker"]["info"])
        print(f"  stores: {planned} tokens planned by the scheduler, {specs} store specs; "
              f"{stored} tokens stored by the worker during the run, {flushed} in the flush "
              f"phase; whole chunks in the prompts: {r['expected_store_tokens']} "
              f"(of {r['prompt_tokens']} prompt tokens)")
        if "lazy" in m:
            a, b = m["lazy"], fl["lazy"]
            print(f"  lazy, end of run: {a}")
            print(f"  lazy, after the flush phase ({len(fl['vllm']['schedule'])} steps, worker "
                  f"mean {summary(fl['worker']['steps'])['mean']:.0f} / max "
                  f"{summary(fl['worker']['steps'])['max']:.0f} µs per step): {b}")
            if b["pending"]:
                print(f"  NOTE: {b['pending']} finished requests ({b['pending_tokens']} tokens) "
                      f"stay buffered, never stored: below the FIFO threshold "
                      f"{LAZY_THRESHOLD} nothing is submitted")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args()
    t_start = time.perf_counter()
    print(f"workload: {args.requests} prompts of {PROMPT_LEN[0]}-{PROMPT_LEN[1]} random tokens, "
          f"{MAX_TOKENS} decode tokens each, one generate call; max_num_seqs {MAX_NUM_SEQS}, "
          f"max_num_batched_tokens {MAX_BATCHED_TOKENS}, prefix caching on; chunk {CHUNK}; "
          f"lazy: FIFO threshold {LAZY_THRESHOLD}, select_count {LAZY_SELECT_COUNT}")
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-sched-") as tmp:
        model_dir = os.path.join(tmp, "model")
        print(f"model: {build(model_dir) / 1e6:.1f}M parameters (2 layers, hidden 256, "
              f"head_dim 64), float32", flush=True)
        results = {mode: sub(mode, model_dir, tmp, args.requests) for mode in CONFIGS}
    report(results)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--run":
        res = run(sys.argv[2], sys.argv[3], int(sys.argv[5]))
        with open(sys.argv[4], "w") as f:
            json.dump(res, f)
        sys.exit(0)
    sys.exit(main())
