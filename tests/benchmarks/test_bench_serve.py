"""benchmarks/bench_serve.py's parts that need no vLLM: trace blocks, ratios, targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _serve_report import Result, table, targets
from _serve_workload import BenchError, run_trace, trace_arrivals, trace_prompts


def _trace(tmp_path: Path, *records: dict) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_hash_id_is_the_same_token_block_in_every_request(tmp_path: Path) -> None:
    path = _trace(tmp_path,
                  {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
                  {"timestamp": 1, "input_length": 900, "output_length": 2, "hash_ids": [7, 9]})
    (first, out1), (second, out2) = trace_prompts(path, shrink=4, limit=10, max_len=4096)
    assert (len(first), len(second), out1, out2) == (256, 225, 4, 2)  # 512/4 tokens a block
    assert first[:128] == second[:128] and first[128:] != second[128:225]


def test_a_bad_trace_line_is_one_error_naming_it(tmp_path: Path) -> None:
    path = _trace(tmp_path, {"hash_ids": [1]})
    with pytest.raises(BenchError, match=r"trace\.jsonl:1: not a Mooncake line"):
        trace_prompts(path, shrink=1, limit=10, max_len=4096)


def test_trace_arrivals_are_the_timestamps_in_seconds(tmp_path: Path) -> None:
    path = _trace(tmp_path, {"timestamp": 500, "hash_ids": [1]}, {"timestamp": 2500},
                  {"hash_ids": [2]}, {"timestamp": 4000})
    assert trace_arrivals(path, limit=3) == [0.0, 2.0, 2.0]  # a line without one: as before
    bad = _trace(tmp_path, {"timestamp": "soon"})
    with pytest.raises(BenchError, match=r"trace\.jsonl:1: timestamp is not a number"):
        trace_arrivals(bad, limit=1)


def test_a_trace_replay_sends_at_the_timestamps_sped_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--trace-speed``: request i leaves at arrivals[i] / speed (here 0, 0.2, 0.4 s
    at speed 10), the gate still capping what is in flight."""
    import asyncio
    import time
    from types import SimpleNamespace

    import _serve_workload

    sent: list[float] = []

    async def stream(client, model, prompt, max_tokens, request):  # type: ignore[no-untyped-def]
        sent.append(time.perf_counter())
        return ""

    class Client:  # the OpenAI client is never reached: _stream is replaced above
        def __init__(self, **_: object) -> None: ...

        async def close(self) -> None: ...

    monkeypatch.setattr(_serve_workload, "_stream", stream)
    monkeypatch.setitem(sys.modules, "openai", SimpleNamespace(AsyncOpenAI=Client))
    serve = SimpleNamespace(api_base="http://127.0.0.1:1/v1", model="m")
    args = SimpleNamespace(concurrency=4, rate=None, seed=0, trace_speed=10.0)
    start = time.perf_counter()
    done = asyncio.run(run_trace(serve, [([1], 1)] * 3, args, [0.0, 2.0, 4.0]))
    assert len(done) == 3
    offsets = [t - start for t in sent]  # (lower bounds only: the machine may be slow)
    assert offsets[1] >= 0.19 and offsets[2] >= 0.39, offsets


def _result(config: str, ttfts: list[float], requests_per_s: float,
            metrics: dict[str, float] | None = None) -> Result:
    return Result(config, config, ttft_s=ttfts, wall_s=len(ttfts) / requests_per_s,
                  requests=len(ttfts), metrics=metrics or {})


def test_hit_ratios_from_metric_differences() -> None:
    r = _result("c", [1.0], 1.0, {"vllm:prefix_cache_hits_total": 25.0,
                                  "vllm:prefix_cache_queries_total": 100.0,
                                  "vllm:lmkv_lookup_miss_tokens_total": 30.0})
    assert r.ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total") == 0.25
    # lmkv never hit: its hit counter is absent, the ratio is 0, not unknown
    assert r.ratio("vllm:lmkv_lookup_hit_tokens_total",
                   "vllm:lmkv_lookup_miss_tokens_total") == 0.0
    assert r.ratio("vllm:external_prefix_cache_hits_total",
                   "vllm:external_prefix_cache_queries_total") is None
    assert "| 0.25 | - | 0.00 | 0 |" in table([r])


def test_targets_compare_configurations_of_one_run() -> None:
    results = [_result("a", [4.0, 4.0, 5.0], 0.5), _result("b", [1.0, 1.0, 1.0], 1.0),
               _result("c", [1.0, 1.2, 2.0], 0.6), Result("g", "g", error="refused")]
    by = {t["ratio"]: t for t in targets(results)}
    assert by["(c)/(a) TTFT p50"]["value"] == pytest.approx(0.3)
    assert by["(c)/(a) TTFT p50"]["met"] is True
    assert by["(c)/(b) TTFT p50"]["value"] == pytest.approx(1.2)
    assert by["(c)/(a) requests/s"]["met"] is True
    assert by["(c)/(g) TTFT p50"]["value"] is None  # (g) refused: no figure, no verdict
    assert by["(d)/(c) TTFT p50"]["met"] is None


def test_the_small_cache_runs_every_request_in_flight_and_stays_under_the_working_set(
) -> None:
    import bench_serve

    def small(*flags: str, longest: int = 2300, unique: int = 11_200) -> int:
        args = bench_serve.parse_args(list(flags))
        return bench_serve.size(args, longest, unique, 1 << 20).small_blocks

    need = -(-(2300 + 16 + 64) // 128)  # the longest prompt, its answer and a margin
    assert small("--answer-tokens", "16", "--concurrency", "1") == 88 // 3
    assert small("--answer-tokens", "16", "--concurrency", "2") == 2 * need + 1
    assert small("--answer-tokens", "16", "--concurrency", "2", "--small-blocks", "29") == 29
    with pytest.raises(BenchError, match="no pressure"):
        small("--answer-tokens", "16", "--concurrency", "5", "--max-num-seqs", "5")
