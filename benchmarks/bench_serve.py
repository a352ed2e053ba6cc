"""Served traffic under KV-memory pressure: multi-round conversations through ``vllm serve``.

Run with the vLLM venv: ``.venv-vllm/bin/python benchmarks/bench_serve.py``
(``./scripts/setup-vllm.sh`` makes it; ``--scale 0.25`` for a quick run).

**Workload.** ``--users`` users chat at once, each ``--rounds`` rounds. Every
prompt starts with one shared system prompt (``--system-tokens``), then the
user's own context (``--context-tokens``: a document of a few thousand tokens),
then the conversation so far: each round appends the previous answer and a
new question (``--question-tokens``); answers are ``--answer-tokens`` long
(greedy, EOS ignored). Token counts are multiplied by ``--scale``. Prompts
are text (a local tokenizer saved with a random-weight Llama). Requests start
at ``--concurrency`` at a time (default), or arrive at ``--rate`` per second
(Poisson); a user's next round waits for its answer. ``--trace FILE`` replays
a Mooncake-format trace instead (each ``hash_ids`` entry is a block of 512
tokens, divided by ``--trace-shrink``; the same id is the same token block;
``--trace-requests`` first lines; prompts as token ids; answers of the trace's
``output_length`` capped at 64 tokens, so that a replay runs here; arrivals at
the trace's timestamps with ``--trace-speed X``, X times faster, else as fast
as ``--concurrency`` / ``--rate`` let them in).

**Sizing.** vLLM's KV cache is set in blocks (``--num-gpu-blocks-override``,
128 tokens a block on CPU): the small cache (``--small-blocks``, default a
third of the working set, at least room for the longest prompt once per
request in flight) cannot hold every
user's conversation, so users evict each other between their rounds; the big
one (``--big-blocks``, default the working set and half again) holds it all.
lmkv's tiers are sized to hold the whole working set. Every server gets
``VLLM_CPU_OMP_THREADS_BIND`` (``--cpus``, default every CPU) and a
``VLLM_CPU_KVCACHE_SPACE`` (GiB) just above its blocks.

**Configurations**, each a fresh ``vllm serve`` (``--configs`` picks some):

* ``a`` vLLM alone, small KV cache (the pressure case);
* ``b`` vLLM alone, big KV cache (the limit lmkv approaches);
* ``c`` lmkv, cpu tier, small KV cache;
* ``d`` lmkv, a cpu tier of a quarter of the working set over a disk (fs) tier;
* ``e`` lmkv, lazy offload (FIFO_MAX_AGE, threshold 1);
* ``f`` lmkv server mode (an ``lmkv server`` with a cpu tier);
* ``g`` vLLM's native offloading (``--kv-offloading-size``: OffloadingConnector);
* ``gs`` the same with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1`` (SimpleCPUOffloadConnector).

A configuration that does not start (e.g. a native connector refusing the
CPU platform) is reported with the one line of its error, and the run goes on.

**Report**, per configuration: TTFT p50/p90/mean (first streamed chunk at the
client), requests/s, output tokens/s, and from the server's ``/metrics``
(difference over the workload): vLLM's prefix-cache hit ratio, the connector's
hit ratio as vLLM counts it (``external_prefix_cache``), lmkv's own lookup hit
ratio (``vllm:lmkv_lookup_hit_tokens_total`` over hit + miss; ``-`` without
it), preemptions. Then the ratios that have targets (``targets``). ``--json FILE``
writes everything; ``--plot FILE.png`` draws each configuration's TTFT
distribution (needs matplotlib; the vLLM venv has none: ``--replot RUN.json
--plot FILE.png`` draws it afterwards from the ``--json`` file in a venv that
has it, e.g. .venv). The workload lives in ``_serve_workload.py``, the
report in ``_serve_report.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from _serve_report import Result, _fmt, plot, table, targets
from _serve_workload import (
    BenchError,
    Conversations,
    run_conversations,
    run_trace,
    trace_arrivals,
    trace_prompts,
)

from lmkv.base.errors import OneLineArgumentParser, run_reporting_errors
from lmkv.testing.serve import (
    ServeStartError,
    VllmServe,
    build_model_dir,
    lmkv_kv_transfer_config,
    start_error_line,
    start_vllm_serve,
    stop_process,
    vllm_env,
)

BLOCK = 128  # vLLM's KV block on the CPU build
CONFIGS = ("a", "b", "c", "d", "e", "f", "g", "gs")
DESCRIPTIONS = {
    "a": "vLLM alone, small KV cache",
    "b": "vLLM alone, big KV cache",
    "c": "lmkv cpu tier, small KV cache",
    "d": "lmkv small cpu tier over disk",
    "e": "lmkv lazy offload",
    "f": "lmkv server mode",
    "g": "vLLM native offload (OffloadingConnector)",
    "gs": "vLLM native offload (SimpleCPUOffloadConnector)",
}
# -- configurations -----------------------------------------------------------------------------

METRICS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
           "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
           "vllm:num_preemptions_total", "vllm:lmkv_lookup_hit_tokens_total",
           "vllm:lmkv_lookup_miss_tokens_total", "vllm:lmkv_loaded_tokens_total",
           "vllm:lmkv_stored_tokens_total", "vllm:lmkv_preempted_resumes_total",
           "vllm:lmkv_lazy_offload_rescues_total", "vllm:lmkv_lazy_offload_skipped_total")


@dataclass(frozen=True)
class Sizing:
    block_bytes: int
    working_set_tokens: int
    max_model_len: int
    small_blocks: int
    big_blocks: int

    @property
    def working_set_bytes(self) -> int:
        return math.ceil(self.working_set_tokens / BLOCK) * self.block_bytes

    def kvcache_gib(self, blocks: int) -> int:
        return max(1, math.ceil(blocks * self.block_bytes * 1.2 / (1 << 30)))


def plan(config: str, sizing: Sizing, args: Any, tmp: str,
         server_address: str | None) -> tuple[dict | None, list[str], dict[str, str]]:
    """(kv-transfer-config, extra flags, extra env) of a configuration."""
    tier_bytes = f"{max(64 << 20, 2 * sizing.working_set_bytes) >> 20}MiB"
    blocks = sizing.big_blocks if config == "b" else sizing.small_blocks
    flags = ["--num-gpu-blocks-override", str(blocks)]
    base = {"lmkv.chunk_size": args.chunk_size}
    cpu = {"type": "cpu", "options": {"max_bytes": tier_bytes}}
    env: dict[str, str] = {}
    if config in ("a", "b"):
        return None, flags, env
    if config == "c":
        return lmkv_kv_transfer_config({**base, "lmkv.tiers": [cpu]}), flags, env
    if config == "d":
        small = f"{max(16 << 20, sizing.working_set_bytes // 4) >> 20}MiB"
        tiers = [{"type": "cpu", "options": {"max_bytes": small}},
                 {"type": "fs", "options": {"url": os.path.join(tmp, "disk"),
                                            "max_bytes": tier_bytes}}]
        return lmkv_kv_transfer_config({**base, "lmkv.tiers": tiers}), flags, env
    if config == "e":
        return lmkv_kv_transfer_config({
            **base, "lmkv.tiers": [cpu], "lmkv.lazy_offload": True,
            "lmkv.lazy_offload_policy": "FIFO_MAX_AGE", "lmkv.lazy_offload_threshold": 1,
            "lmkv.lazy_offload_select_count": 4}), flags, env
    if config == "f":
        return lmkv_kv_transfer_config({**base, "lmkv.mode": "server",
                                        "lmkv.server.address": server_address}), flags, env
    gib = max(0.05, 2 * sizing.working_set_bytes / (1 << 30))
    flags += ["--kv-offloading-size", f"{gib:.3f}", "--kv-offloading-backend", "native"]
    env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1" if config == "gs" else "0"
    return None, flags, env


def run_config(config: str, model_dir: str, sizing: Sizing, args: Any, tmp: str,
               workload: Any, arrivals: list[float] | None = None) -> Result:
    result = Result(config, DESCRIPTIONS[config])
    server = None
    try:
        address = None
        if config == "f":
            from lmkv.testing.server import spawn_server
            tier = f"{max(64 << 20, 2 * sizing.working_set_bytes) >> 20}MiB"
            server, address = spawn_server(tmp, f"tiers:\n  - type: cpu\n    options: "
                                                f"{{max_bytes: {tier}}}\n")
        transfer, flags, extra_env = plan(config, sizing, args, tmp, address)
        blocks = sizing.big_blocks if config == "b" else sizing.small_blocks
        env = vllm_env(kvcache_gib=sizing.kvcache_gib(blocks), threads_bind=args.cpus)
        env.update(extra_env)
        started = time.monotonic()
        try:
            serve = start_vllm_serve(
                model_dir, log_dir=tmp, kv_transfer_config=transfer, env=env, name=config,
                args=["--dtype", "float32", "--max-model-len", str(sizing.max_model_len),
                      "--enforce-eager", "--max-num-seqs", str(args.max_num_seqs),
                      "--seed", "0", *flags])
        except ServeStartError as exc:
            with open(exc.log_path, errors="replace") as log:
                result.error = start_error_line(log.read())
            return result
        result.startup_s = time.monotonic() - started
        try:
            asyncio.run(_warm(serve))
            before = serve.metrics()
            t0 = time.perf_counter()
            if args.trace:
                done = asyncio.run(run_trace(serve, workload, args, arrivals))
            else:
                done = asyncio.run(run_conversations(serve, workload, args))
            result.wall_s = time.perf_counter() - t0
            time.sleep(args.metrics_wait)  # vLLM publishes connector stats periodically
            after = serve.metrics()
        finally:
            result.left_behind = serve.stop()
        result.ttft_s = [r.ttft_s for r in done]
        result.requests = len(done)
        result.output_tokens = sum(r.output_tokens for r in done)
        result.metrics = {m: after[m] - before.get(m, 0.0) for m in METRICS if m in after}
    finally:
        if server is not None:
            result.left_behind += stop_process(server, what="lmkv server")
    return result


async def _warm(serve: VllmServe) -> None:
    """One short request: the first request's one-time costs stay out of the figures."""
    import openai
    client = openai.AsyncOpenAI(base_url=serve.api_base, api_key="unused", timeout=600)
    await client.completions.create(model=serve.model, prompt="warm up", max_tokens=2,
                                    temperature=0)
    await client.close()


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> Any:
    parser = OneLineArgumentParser(prog="bench_serve.py", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--configs", default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)}")
    add("--users", type=int, default=8)
    add("--rounds", type=int, default=3)
    add("--system-tokens", type=int, default=1024)
    add("--context-tokens", type=int, default=3072)
    add("--question-tokens", type=int, default=32)
    add("--answer-tokens", type=int, default=32)
    add("--scale", type=float, default=1.0, help="multiplies system and context tokens")
    add("--concurrency", type=int, default=2)
    add("--rate", type=float, default=None, help="Poisson arrivals per second instead")
    add("--trace", default=None, help="a Mooncake-format JSONL trace to replay instead")
    add("--trace-shrink", type=int, default=16, help="divide the trace's lengths by this")
    add("--trace-requests", type=int, default=40, help="replay the trace's first N lines")
    add("--trace-speed", type=float, default=None,
        help="send the trace's requests at its timestamps, this many times faster "
             "(default: as fast as --concurrency / --rate let them in)")
    add("--small-blocks", type=int, default=None, help="vLLM KV blocks of the small cache")
    add("--big-blocks", type=int, default=None, help="vLLM KV blocks of the big cache")
    add("--chunk-size", type=int, default=256, help="lmkv.chunk_size")
    add("--max-num-seqs", type=int, default=4)
    add("--hidden", type=int, default=512, help="model hidden size")
    add("--layers", type=int, default=4, help="model layers")
    add("--cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU)")
    add("--metrics-wait", type=float, default=6.0,
        help="seconds to wait before the last /metrics scrape")
    add("--seed", type=int, default=0)
    add("--json", default=None, help="write the results to this file")
    add("--plot", default=None, help="write a TTFT distribution plot (PNG)")
    add("--replot", default=None, metavar="JSON",
        help="only draw --plot from an earlier run's --json (needs no vLLM: any venv "
             "with matplotlib)")
    args = parser.parse_args(argv)
    if args.replot and not args.plot:
        parser.error("--replot: needs --plot FILE.png")
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        parser.error(f"--configs: unknown {','.join(unknown) or '(none)'}; "
                     f"choose from {','.join(CONFIGS)}")
    args.configs = chosen
    for name in ("users", "rounds", "concurrency", "answer_tokens", "question_tokens",
                 "trace_shrink", "trace_requests", "chunk_size", "max_num_seqs", "hidden",
                 "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be a positive integer")
    if args.scale <= 0 or (args.rate is not None and args.rate <= 0) \
            or (args.trace_speed is not None and args.trace_speed <= 0):
        parser.error("--scale, --rate and --trace-speed must be positive")
    if args.chunk_size % BLOCK:
        parser.error(f"--chunk-size: must be a multiple of vLLM's block ({BLOCK})")
    return args


def size(args: Any, longest: int, unique_tokens: int, block_bytes: int) -> Sizing:
    max_len = math.ceil((longest + args.answer_tokens + 64) / BLOCK) * BLOCK
    need = math.ceil(max_len / BLOCK)
    working = math.ceil(unique_tokens / BLOCK)
    # The small cache runs the requests the client keeps in flight at once, so
    # TTFT measures reuse, not vLLM's queue for room; the working set still
    # exceeds it, so users evict each other between their rounds.
    lanes = min(args.concurrency if args.rate is None else args.max_num_seqs,
                args.max_num_seqs)
    small = args.small_blocks or max(lanes * need + 1, working // 3)
    big = args.big_blocks or max(small + 1, working * 3 // 2 + need)
    if small < need:
        raise BenchError(f"--small-blocks {small}: the longest prompt needs {need} blocks")
    if small >= working:
        raise BenchError(f"the small KV cache ({small} blocks) holds the whole working set "
                         f"({working} blocks): no pressure; add --users or set "
                         f"--small-blocks below {working}")
    return Sizing(block_bytes, unique_tokens, max_len, small, big)


def replot(args: Any) -> int:
    try:
        with open(args.replot) as f:
            rows = json.load(f)["results"]
        results = [Result(r["config"], r["description"], r.get("error"), list(r["ttft_s"]))
                   for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"--replot {args.replot}: not a bench_serve.py --json file "
                         f"({exc})") from None
    plot(results, args.plot)
    return 0


def main(args: Any) -> int:
    if args.replot:
        return replot(args)
    from transformers import AutoTokenizer

    trace = arrivals = None  # read first: a bad trace line fails before anything is built
    if args.trace:
        trace = trace_prompts(args.trace, args.trace_shrink, args.trace_requests, 16384)
        if args.trace_speed is not None:
            arrivals = trace_arrivals(args.trace, args.trace_requests)
    layers, kv_heads, head_dim = args.layers, max(1, args.hidden // 128), 64
    block_bytes = layers * 2 * kv_heads * head_dim * BLOCK * 4  # float32 K and V
    with tempfile.TemporaryDirectory(prefix="lmkv-bench-serve-") as tmp:
        model_dir = build_model_dir(
            os.path.join(tmp, "model"), hidden_size=args.hidden, num_layers=layers,
            num_heads=max(1, args.hidden // 64), num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=2 * args.hidden, max_position_embeddings=32768)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if trace is not None:
            workload: Any = trace
            longest = max(len(ids) for ids, _ in workload)
            blocks: set[int] = set()  # distinct prefix blocks, chained as vLLM keys them
            for ids, _ in workload:
                chain = 0
                for end in range(BLOCK, len(ids) + 1, BLOCK):
                    chain = hash((chain, tuple(ids[end - BLOCK:end])))
                    blocks.add(chain)
            unique = len(blocks) * BLOCK
            shape = (f"trace {args.trace}: {len(workload)} requests, /{args.trace_shrink} "
                     f"lengths, longest {longest} tokens")
        else:
            workload = Conversations(tokenizer, args)
            last = workload.system + workload.contexts[0] + "".join(
                q + " x" * args.answer_tokens for q in workload.questions[0])
            longest = workload.tokens(last)
            unique = workload.tokens(workload.system) + args.users * (
                longest - workload.tokens(workload.system))
            shape = (f"{args.users} users x {args.rounds} rounds, system "
                     f"{workload.tokens(workload.system)} + context "
                     f"{workload.tokens(workload.contexts[0])} tokens, longest prompt "
                     f"~{longest} tokens, concurrency {args.concurrency}"
                     + (f", rate {args.rate}/s" if args.rate else ""))
        sizing = size(args, longest, unique, block_bytes)
        print(f"workload: {shape}; working set ~{unique} tokens "
              f"({sizing.working_set_bytes / (1 << 20):.0f} MiB of KV); vLLM KV cache "
              f"{sizing.small_blocks} blocks small, {sizing.big_blocks} big; "
              f"max_model_len {sizing.max_model_len}; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        results = []
        for config in args.configs:
            print(f"({config}) {DESCRIPTIONS[config]} ...", flush=True)
            result = run_config(config, model_dir, sizing, args, tmp, workload, arrivals)
            results.append(result)
            print(f"  {'refused: ' + result.error if result.error else 'done'} "
                  f"({result.requests} requests in {result.wall_s:.1f} s; "
                  f"metrics {result.metrics})", flush=True)
            for problem in result.left_behind:
                print(f"  not a clean stop: {problem}", flush=True)
    print()
    print(table(results))
    checks = targets(results)
    print()
    for c in checks:
        met = {True: "met", False: "not met", None: "-"}[c["met"]]
        print(f"{c['ratio']}: {_fmt(c['value'], '.2f')} (target {c['target']}: {met})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sizing": asdict(sizing), "workload": shape,
                       "results": [{**asdict(r), "ttft_p50_s": r.p(0.5), "ttft_p90_s": r.p(0.9),
                                    "ttft_mean_s": r.ttft_mean, "req_per_s": r.req_per_s,
                                    "out_tok_per_s": r.tok_per_s} for r in results],
                       "targets": checks}, f, indent=1, default=str)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(run_reporting_errors(main, parse_args(sys.argv[1:])))
