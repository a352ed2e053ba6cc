"""Lazy offload's rescue (``lmkv/integrations/vllm/lazy.py``) against vLLM 0.32.

Runs in the vLLM venv (``.venv-vllm/bin/python -m pytest tests/vllm``); skipped
where vLLM is not installed.

- vLLM's own ``BlockPool``: watching a finished request's blocks changes no
  reference count and no free count; ``get_new_blocks`` handing one out makes
  that step's plan a ``before_compute`` store of the request's intact blocks;
  ``reset_prefix_cache`` (which fires the same watchers) rescues nothing.
- A real vLLM (subprocess, random-weight Llama, CPU build) under KV pressure,
  with a lazy threshold no run reaches: request P finishes, two other prompts
  take its freed blocks, and P's KV is stored in that step (rescued) rather
  than lost. P asked again loads it from lmkv (vLLM's prefix cache no longer
  has it), and every output equals a run without lmkv. Without the rescue the
  store would never go out (threshold unmet) and P would load nothing.
"""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.vllm
BLOCK, CHUNK = 32, 64
CACHE_BLOCKS = 13  # 12 usable blocks (384 tokens) and vLLM's null block
P_LEN, OTHER_LEN, ANSWER = 200, 300, 8


def _tokens(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


# -- vLLM's own block pool ----------------------------------------------------------

def test_rescue_against_vllms_block_pool() -> None:
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from lmkv.config.model import load_config
    from lmkv.integrations.vllm.connector import _block_hash_of
    from lmkv.integrations.vllm.lazy import LazyOffload
    from lmkv.integrations.vllm.specs import StoreSpec

    block = 16
    init_none_hash(sha256)
    req = Request("p", list(range(100, 164)), SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(block, sha256))
    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=block)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 4, block, 0)
    ids = [b.block_id for b in blocks]
    config = load_config(overrides={"lmkv.lazy_offload": True,
                                    "lmkv.lazy_offload_threshold": 100})
    lazy = LazyOffload(config, block_size=block, world_size=1, pool=pool,
                       block_hash_of=_block_hash_of)
    lazy.add(StoreSpec("p", list(req.all_token_ids), ids), req.block_hashes)

    free_before = pool.get_num_free_blocks()
    lazy.finished("p", ids)  # vLLM's order: request_finished, then the blocks are freed
    assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1]
    assert pool.get_num_free_blocks() == free_before
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == free_before + 4
    assert lazy.select(10) == []  # threshold unmet, nothing handed out

    # The 4 never-used blocks go first; then vLLM reuses p's freed blocks, tail first.
    taken = pool.get_new_blocks(5)
    assert ids[-1] in {b.block_id for b in taken} and taken[-1].block_hash is None
    (spec,) = lazy.select(10)
    assert spec.before_compute and spec.req_id == "p"
    assert spec.block_ids == ids and spec.token_ids == list(range(100, 164))
    assert [b.ref_cnt for b in blocks[:3]] == [0, 0, 0]  # nothing held back
    assert lazy.select(10) == []

    # reset_prefix_cache (sleep, weight updates) fires the watchers too: no rescue.
    req2 = Request("q", list(range(300, 332)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(block, sha256))
    pool.free_blocks(taken)
    blocks2 = pool.get_new_blocks(2)
    pool.cache_full_blocks(req2, blocks2, 0, 2, block, 0)
    lazy.add(StoreSpec("q", list(req2.all_token_ids), [b.block_id for b in blocks2]),
             req2.block_hashes)
    lazy.finished("q", [b.block_id for b in blocks2])
    pool.free_blocks(reversed(blocks2))
    assert pool.reset_prefix_cache()
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert lazy.select(0) == [] and lazy.rescued == 1


# -- a real vLLM under KV pressure --------------------------------------------------

def run(model_dir: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = {}
    if mode == "lazy":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMKVConnector", "kv_connector_module_path": "lmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "lmkv.chunk_size": CHUNK, "lmkv.lazy_offload": True,
                "lmkv.lazy_offload_threshold": 100}}
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32",
              max_model_len=(CACHE_BLOCKS - 1) * BLOCK, block_size=BLOCK,
              enable_prefix_caching=True, max_num_seqs=1, seed=0,
              num_gpu_blocks_override=CACHE_BLOCKS, **kwargs)

    def generate(prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    result: dict = {"outputs": []}
    p = _tokens(P_LEN, 1)
    result["outputs"].append(generate(p))
    for seed in (2, 3):  # each needs most of the cache: p's freed blocks are handed out
        result["outputs"].append(generate(_tokens(OTHER_LEN, seed)))
    counters = None
    if mode == "lazy":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        counters = get_kv_transfer_group().worker_side.counters
        before = counters.loaded_tokens
    result["outputs"].append(generate(p + _tokens(20, 4)))
    if counters is not None:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        result["p_loaded"] = counters.loaded_tokens - before
        result["rescued"] = sched.lazy.rescued
        result["skipped"] = sched.lazy.skipped
        result["worker"] = dict(vars(counters))
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vllm")
    from tests.vllm.subruns import build_small_model, run_modes
    tmp = tmp_path_factory.mktemp("lazy-rescue")
    return run_modes(__file__, build_small_model(tmp), ("baseline", "lazy"), tmp)


@pytest.mark.slow  # a real vLLM run
def test_lazy_offload_rescues_blocks_vllm_hands_out(results: dict) -> None:
    lazy = results["lazy"]
    assert lazy["outputs"] == results["baseline"]["outputs"], "outputs differ without lmkv"
    assert lazy["rescued"] >= 1 and lazy["worker"]["rescued_stores"] >= 1, lazy
    # P's whole chunks came back from lmkv: the rescue stored them before the
    # other prompts' forward overwrote the blocks.
    assert lazy["p_loaded"] == P_LEN // CHUNK * CHUNK, lazy
    assert lazy["worker"]["failed_blocks"] == 0


if __name__ == "__main__":  # a run of run_modes: this folder is sys.path[0]
    from subruns import serve_run
    serve_run(run, lambda: f"usage: {sys.argv[0]} --run MODE MODEL_DIR OUT.json")
