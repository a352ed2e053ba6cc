"""``lmkv.store_decode`` and preemption through a real vLLM (CPU build).

Runs in the vLLM venv (``.venv-vllm/bin/python -m pytest tests/vllm``); skipped
where vLLM is not installed. Each vLLM run is a subprocess (this file with
``--run MODE``) over a random-weight Llama with vLLM blocks of 32 tokens and
lmkv chunks of 64, vLLM's prefix caching off (but in the lazy run) so that
only lmkv can bring KV back:

- two rounds of a conversation: round 1 is prompt P (100 tokens), greedy
  answer A (80 tokens); round 2 is P + A + Q. Without ``store_decode`` round 2
  loads P's whole blocks (96 tokens); with it, P + A's (160: the answer's KV,
  computed while decoding, minus its last token's, which was never computed);
  eager (whole chunks while decoding, up to 128, and the last whole blocks
  when the request finished) and lazy offload. Every output equals a run
  without lmkv.
- preemption: four concurrent requests in a KV cache of 16 blocks (what three
  prompts need) make vLLM preempt; the resumed requests load from lmkv what
  their first run stored (``preempted_resumes``), and every output equals a run
  without lmkv and without preemption.
"""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.vllm
CHUNK, BLOCK = 64, 32
P, A, Q = 100, 80, 20
CACHE_BLOCKS = 17  # the lmkv runs' KV cache: 16 blocks (512 tokens) and vLLM's null block
N_CONCURRENT, LONG_PROMPT, LONG_ANSWER = 4, 150, 60


def _tokens(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def run(model_dir: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = {}
    if mode != "baseline":
        extra: dict = {"lmkv.chunk_size": CHUNK, "lmkv.store_decode": "decode" in mode}
        if mode.startswith("lazy"):
            extra.update({"lmkv.lazy_offload": True, "lmkv.lazy_offload_threshold": 1})
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMKVConnector", "kv_connector_module_path": "lmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
        kwargs["num_gpu_blocks_override"] = CACHE_BLOCKS
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=512,
              block_size=BLOCK, enable_prefix_caching=mode.startswith("lazy"),
              max_num_seqs=N_CONCURRENT, seed=0, disable_log_stats=False, **kwargs)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    counters = None
    sched = None
    if mode != "baseline":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        counters = get_kv_transfer_group().worker_side.counters
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    result: dict = {}
    prompt = _tokens(P, 1)
    (answer,) = generate([prompt], A)
    if mode.startswith("lazy"):
        # steps with scheduled tokens: the store goes out, the workers confirm it
        generate([_tokens(40, 9)], 16)
        from subruns import settle  # this folder is sys.path[0] in a run
        settle(llm)
        assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
    before = counters.loaded_tokens if counters else 0
    (second,) = generate([prompt + answer + _tokens(Q, 2)], 16)
    result["rounds"] = [answer, second]
    if counters is not None:
        result["round2_loaded"] = counters.loaded_tokens - before
    if not mode.startswith("lazy"):
        result["concurrent"] = generate([_tokens(LONG_PROMPT, 10 + i)
                                         for i in range(N_CONCURRENT)], LONG_ANSWER)
    if sched is not None:
        # One more engine step (vLLM's server loop takes it by itself after requests
        # finish): finished requests' decode tails are stored, their blocks freed.
        llm.llm_engine.step()
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        result["blocks_in_use"] = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        result["scheduler_counters"] = dict(vars(sched.counters))
        result["worker_counters"] = dict(vars(counters))
    result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                         if "preempt" in m.name or "decode_stored" in m.name}
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vllm")
    from tests.vllm.subruns import build_small_model, run_modes
    tmp = tmp_path_factory.mktemp("decode-preempt")
    return run_modes(__file__, build_small_model(tmp),
                     ("baseline", "eager", "eager-decode", "lazy-decode"), tmp)


@pytest.mark.slow  # real vLLM runs
def test_store_decode_loads_the_answer_in_the_next_round(results: dict) -> None:
    base = results["baseline"]["rounds"]
    whole = lambda n: n // BLOCK * BLOCK  # noqa: E731
    for mode in ("eager", "eager-decode", "lazy-decode"):
        got = results[mode]
        assert got["rounds"] == base, f"{mode}: outputs differ from a run without lmkv"
        # round 2 may not load its last token: what lmkv holds of P (+ A), in whole blocks
        expected = whole(P + A - 1) if "decode" in mode else whole(P)
        assert got["round2_loaded"] == expected, mode
        decode = got["scheduler_counters"]["decode_stored_tokens"]
        assert (decode > 0) == ("decode" in mode), mode
        # ... and vLLM's metrics carry it (/metrics serves it as ..._total)
        exported = got["metrics"].get("vllm:lmkv_decode_stored_tokens") or 0
        assert exported == decode, (mode, got["metrics"])
        assert got["blocks_in_use"] == 0, f"{mode}: blocks never freed"
    assert results["eager-decode"]["round2_loaded"] > results["eager"]["round2_loaded"]


def test_a_worker_reports_a_finished_requests_last_store(tmp_path) -> None:
    """A ``release`` store (a finished request's decode tail) is reported by
    ``take_finished_saves`` once, so that vLLM frees the request's blocks."""
    pytest.importorskip("vllm")
    from lmkv.integrations.vllm.metadata import LMKVConnectorMetadata, StoreSpec
    from tests.vllm.test_worker_vllm import caches, worker

    side = worker(tmp_path)
    side.register(caches("cpu"))
    try:
        assert side.take_finished_saves() is None
        side.save(LMKVConnectorMetadata(stores=[
            StoreSpec("r", list(range(32)), [4, 1], release=True),
            StoreSpec("s", list(range(100, 116)), [2])]))
        assert side.take_finished_saves() == {"r"}
        assert side.take_finished_saves() is None
        assert side.counters.stored_tokens == 48
    finally:
        side.close()


@pytest.mark.slow  # real vLLM runs
@pytest.mark.parametrize("mode", ["eager", "eager-decode"])
def test_preempted_requests_resume_from_lmkv(results: dict, mode: str) -> None:
    got = results[mode]
    assert sum(v or 0 for v in got["metrics"].values()) > 0, \
        f"vLLM did not preempt: {got['metrics']}"
    assert got["scheduler_counters"]["preempted_resumes"] > 0
    assert got["metrics"].get("vllm:lmkv_preempted_resumes") \
        == got["scheduler_counters"]["preempted_resumes"], got["metrics"]
    assert got["concurrent"] == results["baseline"]["concurrent"]
    assert got["worker_counters"]["failed_blocks"] == 0


if __name__ == "__main__":  # a run of run_modes: this folder is sys.path[0]
    from subruns import serve_run
    serve_run(run, lambda: f"usage: {sys.argv[0]} --run MODE MODEL_DIR OUT.json")
