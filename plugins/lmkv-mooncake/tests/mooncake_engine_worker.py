"""One engine process for the two-process test: cpu tier + mooncake tier.

    python mooncake_engine_worker.py store|retrieve OPTIONS_JSON OUT_FILE

The tier is a pure client (no segment): the pool is what the test process
holds, so the KV outlives the process that stored it.
"""

from __future__ import annotations

import json
import sys

import torch

from lmkv import KVSpec, load_config
from lmkv.testing.engines import open_local_engine

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32
TOKENS = list(range(1000, 1000 + 8 * CHUNK + 5))  # 8 whole chunks and a tail


def hf_kv(total: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, total, 16, generator=gen).half(),
             torch.randn(1, 2, total, 16, generator=gen).half()) for _ in range(2)]


def main(mode: str, options: str, out: str) -> None:
    config = load_config(env={}, overrides={
        "lmkv.chunk_size": CHUNK,
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": 8 << 20}},
                       {"type": "mooncake", "options": json.loads(options)}]})
    with open_local_engine(config, SPEC, model_name="two-processes") as engine:
        report: dict = {"lookup_before": engine.lookup(TOKENS)}
        if mode == "store":
            report["stored"] = engine.store(TOKENS, kv=hf_kv(len(TOKENS)))
            report["flushed"] = engine.storage.flush(30)
        else:
            result = engine.retrieve(TOKENS)
            report["retrieved"] = result.num_tokens
            torch.save(result.kv, out + ".kv")
        report["tiers"] = engine.stats()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
