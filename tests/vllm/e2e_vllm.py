"""End-to-end check of LMKVConnector against a real vLLM (CPU build).

Run with the vLLM venv: ``./scripts/setup-vllm.sh && .venv-vllm/bin/python
tests/vllm/e2e_vllm.py`` (a step of .ci/run).
Each vLLM run is a subprocess: a baseline without lmkv, then lmkv with eager
offload (vLLM prefix caching off), then lmkv with lazy offload (FIFO,
threshold 1; prefix caching on, as lazy offload verifies block hashes), then
with asynchronous loads (``lmkv.async_load``: vLLM schedules the second request
once the worker reported its load finished), then layer by layer (``lmkv.layerwise``: vLLM
must call the per-layer hooks, and the loads and stores must run layer by
layer; then, in the same process, its loads fail: the second prompt again
must still generate the baseline's tokens). A run whose loads all fail must
report the blocks and generate the baseline's tokens (vLLM recomputes). The
second prompt shares a long prefix with the first and must load it from lmkv
and generate exactly the baseline's tokens (greedy). In the lazy run a filler
request's step submits the first request's store, then vLLM's own prefix
cache is reset so the prefix can only come from lmkv. Then two more vLLM
processes share a disk tier: the first stores the first prompt's KV; the second,
started afterwards with an empty cpu tier, must load the shared prefix from disk.
Then server mode: an ``lmkv server`` owns the tiers; one vLLM process stores
through it, and a second one, started afterwards, loads the prefix from it.
Then a Mooncake pool (when lmkv-mooncake and a Mooncake client are installed,
as scripts/setup-vllm.sh does): a ``mooncake_master`` on loopback and a holder
process lending the pool its memory; one vLLM process stores through the
``mooncake`` tier, a second one, started afterwards, loads the prefix from it;
and the same again through a ``mooncake_client`` holding the pool, both vLLM
processes thin clients of it (``client_address``).
Then tenants: the first prompt under ``cache_salt`` "a", then the second under
"b", under none and under "a": only the same salt may load the shared prefix,
and every output equals the baseline's. Last, LoRA: two adapters with random
weights built with peft; the first prompt under adapter "sql", then the second
under the base model, under "chat" and under "sql": only "sql" may load the
prefix, and its output equals a LoRA run without lmkv (``lora-baseline``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHUNK = 256
BLOCK = 128  # vLLM's CPU block size: lmkv hits at it inside its chunks
PREFIX, TAIL1, TAIL2 = 640, 60, 100  # the prompts part mid-chunk, on a block boundary
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    import random
    rng = random.Random(0)
    prefix = [rng.randrange(10, 8000) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(10, 8000) for _ in range(TAIL1)],
            prefix + [rng.randrange(10, 8000) for _ in range(TAIL2)]]


def build(model_dir: str) -> None:
    import torch

    from lmkv.integrations.hf_model import build_model, build_tokenizer
    model = build_model(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=64, intermediate_size=512, max_position_embeddings=2048,
                        dtype=torch.float32)
    model.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)


def build_adapters(model_dir: str, out_dir: str) -> dict[str, str]:
    """Two LoRA adapters of random (non-zero) weights for the model: name -> path."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, seed in (("sql", 1), ("chat", 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                 target_modules=["q_proj", "k_proj", "v_proj"])
        paths[name] = os.path.join(out_dir, f"lora-{name}")
        peft.get_peft_model(model, config).save_pretrained(paths[name])
    return paths


def run(model_dir: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[lmkv] %(levelname)s %(message)s"))
    logging.getLogger("lmkv").addHandler(handler)
    logging.getLogger("lmkv").setLevel(logging.INFO)
    kwargs: dict = {}
    extra: dict = {"lmkv.chunk_size": CHUNK}
    if mode == "corrupt":  # negative control: noisy loaded KV must change the output
        _corrupt_loads()
    if mode == "load-fails":  # every load fails: vLLM must recompute, output unchanged
        _failing_loads()
    if mode == "lazy":
        extra.update({"lmcache.mp.lazy_offload": True,
                      "lmcache.mp.lazy_offload_threshold": 1})
    if mode == "async":
        extra["lmkv.async_load"] = True
    if mode.startswith("layerwise"):
        extra["lmkv.layerwise"] = True
    if mode.startswith("disk"):
        extra["lmkv.tiers"] = [{"type": "cpu", "options": {"max_bytes": "256MiB"}},
                               {"type": "fs", "options": {"url": os.environ["E2E_DISK_TIER_DIR"]}}]
    if mode.startswith("mooncake"):
        pool = "E2E_MOONCAKE_CLIENT" if mode.startswith("mooncake-client") else "E2E_MOONCAKE"
        extra["lmkv.tiers"] = [{"type": "cpu", "options": {"max_bytes": "256MiB"}},
                               {"type": "mooncake", "options": json.loads(os.environ[pool])}]
    if mode.startswith("server"):
        extra.update({"lmkv.mode": "server",
                      "lmkv.server.address": os.environ["E2E_SERVER_ADDRESS"]})
    if mode != "baseline":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMKVConnector",
            "kv_connector_module_path": "lmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    if mode.startswith("lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if mode == "lora-baseline":
        kwargs.pop("kv_transfer_config", None)
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=2048,
              enable_prefix_caching=mode == "lazy", max_num_seqs=4, seed=0,
              disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(p: list[int], salt: str | None = None, lora: str | None = None) -> list[int]:
        prompt = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            prompt["cache_salt"] = salt
        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest
            adapters = json.loads(os.environ["E2E_LORA_ADAPTERS"])
            lora_request = LoRARequest(lora, list(adapters).index(lora) + 1, adapters[lora])
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)
        return list(out[0].outputs[0].token_ids)

    first, second = prompts()
    if mode == "lora-baseline":
        return {"outputs": [generate(second, lora="sql")]}
    if mode == "lora":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        counters = get_kv_transfer_group().worker_side.counters
        generate(first, lora="sql")
        outputs, loaded = [], []
        for lora in (None, "chat", "sql"):
            before = counters.loaded_tokens
            outputs.append(generate(second, lora=lora))
            loaded.append(counters.loaded_tokens - before)
        return {"outputs": outputs, "loaded": loaded}
    if mode == "salt":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        counters = get_kv_transfer_group().worker_side.counters
        generate(first, "a")
        outputs, loaded = [], []
        for salt in ("b", None, "a"):
            before = counters.loaded_tokens
            outputs.append(generate(second, salt))
            loaded.append(counters.loaded_tokens - before)
        return {"outputs": outputs, "loaded": loaded}
    if mode.startswith(("disk", "server", "mooncake")):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker_side
        # the writer only stores; the reader, a fresh process, only asks
        outputs = [generate(first if mode.endswith("writer") else second)]
        if mode.startswith(("disk", "mooncake")):
            assert worker.engine.storage.flush(60), "the disk writes did not finish"
        return {"outputs": outputs, "worker_counters": vars(worker.counters),
                "metrics": _metrics(llm)}
    waits = _count_layer_waits() if mode.startswith("layerwise") else None
    outputs = [generate(first)]  # stored (eager) or buffered (lazy) before the second
    if mode == "lazy":
        generate(list(range(20, 120)))  # a step with scheduled tokens: the store goes out
        from subruns import settle  # this folder is sys.path[0] in a run
        settle(llm)  # idle steps until the workers confirm it and the blocks go back
        assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
    outputs.append(generate(second))
    result: dict = {"outputs": outputs, "metrics": _metrics(llm)}
    if mode != "baseline":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        result["worker_counters"] = dict(vars(get_kv_transfer_group().worker_side.counters))
        if waits is not None:
            result["layer_waits"] = waits[0]
        if mode == "layerwise":  # the failing-load control, in the same process
            counters = get_kv_transfer_group().worker_side.counters
            failed, loaded = counters.failed_blocks, counters.loaded_tokens
            _failing_loads()
            result["failing"] = {"outputs": [outputs[0], generate(second)],
                                 "failed_blocks": counters.failed_blocks - failed,
                                 "loaded_tokens": counters.loaded_tokens - loaded}
        sched = _scheduler_side(llm)
        if sched is not None:
            result["scheduler_counters"] = {k: v for k, v in vars(sched.counters).items()
                                            if k != "extra"}
            if sched.lazy is not None:
                result["lazy"] = {"skipped": sched.lazy.skipped,
                                  "protected": sched.lazy.protected_stores,
                                  "pending": len(sched.lazy.policy)}
    return result


def _corrupt_loads() -> None:
    import torch

    from lmkv_backends.connectors.paged import PagedConnector
    original = PagedConnector.from_chunks

    def noisy(self, spans, **kv):  # type: ignore[no-untyped-def]
        for span in spans:
            span.buffer.add_(torch.randn_like(span.buffer))
        return original(self, spans, **kv)

    PagedConnector.from_chunks = noisy  # type: ignore[method-assign]


def _count_layer_waits() -> list[int]:
    """Count vLLM's calls of ``wait_for_layer_load`` (the per-layer hook is used)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    wait, count = connector.wait_for_layer_load, [0]

    def counted(layer_name: str) -> None:
        count[0] += 1
        wait(layer_name)

    connector.wait_for_layer_load = counted  # type: ignore[method-assign]
    return count


def _failing_loads() -> None:
    from lmkv.engines.local import LocalEngine

    def fail(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated: the chunks vanished between lookup and load")

    LocalEngine.retrieve = fail  # type: ignore[method-assign]


def _metrics(llm: object) -> dict:
    """vLLM's counters about external (connector) hits, where this vLLM has them."""
    try:
        metrics = llm.get_metrics()  # type: ignore[attr-defined]
    except Exception as exc:  # report it; the check does not depend on it
        return {"error": repr(exc)}
    return {m.name: getattr(m, "value", None) for m in metrics
            if "external" in m.name or "connector" in m.name or "prefix_cache" in m.name}


def _scheduler_side(llm: object) -> object | None:
    """The scheduler's connector side (in-process engine core only)."""
    try:
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        return core.scheduler.connector.scheduler_side
    except AttributeError:
        return None


def main() -> int:
    cpus = f"0-{(os.cpu_count() or 1) - 1}"  # every configuration gets every CPU
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.TemporaryDirectory(prefix="lmkv-e2e-") as tmp:
        model_dir = os.path.join(tmp, "model")
        build(model_dir)
        results = {}
        env["E2E_DISK_TIER_DIR"] = os.path.join(tmp, "disk")
        env["E2E_LORA_ADAPTERS"] = json.dumps(build_adapters(model_dir, tmp))
        from lmkv.testing.server import spawn_server
        server, env["E2E_SERVER_ADDRESS"] = spawn_server(
            tmp, "tiers:\n  - type: cpu\n    options: {max_bytes: 256MiB}\n", env=env)
        from lmkv.testing.mooncake import MooncakePool
        pool = client_pool = None
        try:
            if MooncakePool.available():
                pool = MooncakePool(tmp)
                # The same through the host's mooncake_client: thin clients both.
                client_pool = MooncakePool(tmp, real_client=True)
        except BaseException:  # (a pool that cannot start: nothing left running)
            if pool is not None:
                pool.close()
            server.terminate()
            raise
        if pool is None and os.environ.get("CI_REQUIRE_MOONCAKE") == "1":
            raise SystemExit("CI_REQUIRE_MOONCAKE=1 but lmkv-mooncake or the Mooncake "
                             "client is not installed in this venv (scripts/setup-vllm.sh "
                             "installs them)")
        if pool is None:
            print("NOTE: lmkv-mooncake or the Mooncake client is not installed in this venv: "
                  "skipping the mooncake rows (scripts/setup-vllm.sh installs them)")
        else:
            env["E2E_MOONCAKE"] = json.dumps(pool.options)
            env["E2E_MOONCAKE_CLIENT"] = json.dumps(client_pool.options)
        modes = ["baseline", "eager", "lazy", "async", "layerwise", "corrupt", "load-fails",
                 "disk-writer", "disk-reader", "server-writer", "server-reader",
                 *(["mooncake-writer", "mooncake-reader", "mooncake-client-writer",
                    "mooncake-client-reader"] if pool else []),
                 "salt", "lora-baseline", "lora"]
        only = os.environ.get("E2E_ONLY")  # a comma-separated subset, while developing
        if only:
            modes = [m for m in modes if m in only.split(",")]
        try:
            for mode in modes:
                out = os.path.join(tmp, f"{mode}.json")
                rc = subprocess.call([sys.executable, __file__, "--run", mode, model_dir, out],
                                     env=env)
                if rc != 0:
                    print(f"FAIL: the {mode} run exited {rc}")
                    return 1
                with open(out) as f:
                    results[mode] = json.load(f)
        finally:
            for mooncake in (pool, client_pool):
                if mooncake is not None:
                    mooncake.close()
            server.terminate()
            server_rc = server.wait(60)
            server_log = "".join(Path(p).read_text()
                                 for p in glob.glob(os.path.join(tmp, "server-*.log")))
    if server_rc != 0:
        print(f"FAIL: the lmkv server exited {server_rc}:\n{server_log}")
        return 1
    if only:
        return _check_subset(results)
    base = results["baseline"]
    print("baseline outputs:", base["outputs"])
    # Every whole block the prompts share (2.5 chunks): what vLLM's prefix cache hits.
    expected_hit = min((len(prompts()[1]) - 1) // BLOCK, PREFIX // BLOCK) * BLOCK
    ok = True
    for mode in ("eager", "lazy", "async", "layerwise"):
        lm = results[mode]
        counters = lm["worker_counters"]
        print(f"{mode} outputs:", lm["outputs"])
        for key in ("worker_counters", "scheduler_counters", "lazy", "metrics"):
            if key in lm:
                print(f"{mode} {key}:", lm[key])
        if lm["outputs"] != base["outputs"]:
            print(f"FAIL ({mode}): outputs differ from the baseline")
            ok = False
        if counters["loaded_tokens"] != expected_hit:
            print(f"FAIL ({mode}): loaded {counters['loaded_tokens']} tokens from lmkv; "
                  f"expected {expected_hit}")
            ok = False
        if counters["failed_blocks"]:
            print(f"FAIL ({mode}): failed blocks")
            ok = False
        if lm.get("lazy", {}).get("protected"):
            print(f"FAIL ({mode}): protected blocks never released")
            ok = False
    corrupt = results["corrupt"]
    print("corrupt (noisy loads) outputs:", corrupt["outputs"])
    if corrupt["worker_counters"]["loaded_tokens"] != expected_hit or \
            corrupt["outputs"][1] == base["outputs"][1]:
        print("FAIL (corrupt): noisy loaded KV did not change the output: the check is blind")
        ok = False
    layerwise = results["layerwise"]
    print("layerwise: vLLM's wait_for_layer_load calls:", layerwise["layer_waits"])
    if not layerwise["worker_counters"]["layerwise_loads"] or \
            not layerwise["worker_counters"]["layerwise_stores"] or not layerwise["layer_waits"]:
        print("FAIL (layerwise): the loads or stores did not run layer by layer")
        ok = False
    failing = layerwise["failing"]
    results["layerwise-load-fails"] = {
        "outputs": failing["outputs"],
        "worker_counters": {k: v for k, v in failing.items() if k != "outputs"}}
    for mode in ("load-fails", "layerwise-load-fails"):
        fails = results[mode]
        print(f"{mode} (every load raises) outputs:", fails["outputs"],
              "worker_counters:", fails["worker_counters"])
        if fails["outputs"] != base["outputs"] or \
                fails["worker_counters"]["failed_blocks"] != expected_hit // BLOCK:
            print(f"FAIL ({mode}): failed loads were not reported and recomputed")
            ok = False
    shared = ("disk", "server", *(("mooncake", "mooncake-client") if "mooncake-reader" in results
                                  else ()))
    for tier in shared:  # a second process reuses what the first stored
        writer, reader = results[f"{tier}-writer"], results[f"{tier}-reader"]
        print(f"{tier} writer worker_counters:", writer["worker_counters"])
        print(f"{tier} reader (a second vLLM process) worker_counters:",
              reader["worker_counters"], "metrics:", reader["metrics"])
        if writer["worker_counters"]["stored_tokens"] < expected_hit:
            print(f"FAIL ({tier}): the first process stored too little")
            ok = False
        if reader["worker_counters"]["loaded_tokens"] != expected_hit or \
                reader["outputs"][0] != base["outputs"][1]:
            print(f"FAIL ({tier}): the second process did not reuse the first one's KV exactly")
            ok = False
    salt = results["salt"]
    print("salt outputs:", salt["outputs"], "loaded (salt b, none, a):", salt["loaded"])
    if salt["loaded"] != [0, 0, expected_hit] or \
            any(out != base["outputs"][1] for out in salt["outputs"]):
        print("FAIL (salt): a tenant loaded another's KV, or its own did not load exactly")
        ok = False
    lora, lora_base = results["lora"], results["lora-baseline"]
    print("lora outputs (base, chat, sql):", lora["outputs"], "loaded:", lora["loaded"],
          "sql without lmkv:", lora_base["outputs"])
    if lora["loaded"] != [0, 0, expected_hit] or lora["outputs"][0] != base["outputs"][1] \
            or lora["outputs"][2] != lora_base["outputs"][0] \
            or lora["outputs"][2] == base["outputs"][1]:
        print("FAIL (lora): an adapter or the base model loaded another's KV, or the "
              "adapter's reused KV changed its output")
        ok = False
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


def _check_subset(results: dict) -> int:
    """``E2E_ONLY=baseline,mooncake-writer,mooncake-reader``: the sharing check alone."""
    base = results["baseline"]
    expected_hit = min((len(prompts()[1]) - 1) // BLOCK, PREFIX // BLOCK) * BLOCK
    ok = True
    for tier in ("disk", "server", "mooncake", "mooncake-client"):
        if f"{tier}-reader" not in results:
            continue
        writer, reader = results[f"{tier}-writer"], results[f"{tier}-reader"]
        print(f"{tier} writer:", writer["worker_counters"])
        print(f"{tier} reader:", reader["worker_counters"], reader["outputs"])
        if writer["worker_counters"]["stored_tokens"] < expected_hit or \
                reader["worker_counters"]["loaded_tokens"] != expected_hit or \
                reader["outputs"][0] != base["outputs"][1]:
            print(f"FAIL ({tier}): the second process did not reuse the first one's KV exactly")
            ok = False
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":  # run as a script: this folder is sys.path[0]
    from subruns import serve_run
    serve_run(run, main)
