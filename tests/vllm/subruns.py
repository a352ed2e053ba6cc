"""Real vLLM runs in subprocesses for the tests of this folder: a small
random-weight Llama saved with its tokenizer, and each mode of a test file run
as ``python FILE --run MODE MODEL_DIR OUT.json`` (one vLLM per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path


def build_small_model(tmp: Path) -> str:
    """A 2-layer float32 Llama and its tokenizer in ``tmp/model``."""
    import torch

    from lmkv.integrations.hf_model import build_model, build_tokenizer
    model_dir = str(tmp / "model")
    build_model(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                intermediate_size=512, max_position_embeddings=1024,
                dtype=torch.float32).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    return model_dir


def run_modes(script: str, model_dir: str, modes: Iterable[str], tmp: Path) -> dict:
    """``script --run MODE`` for each mode, on vLLM's CPU build in one process each;
    the JSON each wrote, by mode."""
    cpus = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{(os.cpu_count() or 1) - 1}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = {}
    for mode in modes:
        path = tmp / f"{mode}.json"
        proc = subprocess.run([sys.executable, script, "--run", mode, model_dir, str(path)],
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"the {mode} run failed:\n{proc.stderr[-4000:]}"
        out[mode] = json.loads(path.read_text())
    return out


def settle(llm: object) -> None:
    """Step an idle ``vllm.LLM`` while its connector's lazy stores hold blocks the
    workers have not confirmed (``has_pending_push_work``: vLLM's server loop steps
    by itself then; an in-process ``LLM.generate`` returns first). The hook's own
    bound ends the loop; the stores must be confirmed by then."""
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    connector = core.scheduler.connector
    while connector.has_pending_push_work():
        llm.llm_engine.step()  # type: ignore[attr-defined]
    lazy = connector.scheduler_side.lazy
    assert lazy is None or lazy.protected_stores == 0, "lazy stores were never confirmed"


def serve_run(run: Callable[[str, str], dict], usage: Callable[[], int | str]) -> None:
    """A test file's ``__main__``: ``--run MODE MODEL_DIR OUT.json`` writes
    ``run(MODEL_DIR, MODE)`` as JSON; anything else exits with ``usage()``."""
    if len(sys.argv) == 5 and sys.argv[1] == "--run":
        res = run(sys.argv[3], sys.argv[2])
        with open(sys.argv[4], "w") as f:
            json.dump(res, f)
        sys.exit(0)
    sys.exit(usage())
