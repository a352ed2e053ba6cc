"""A well-formed frame of the wrong shape under the right key is removed and counted
as corrupt, in the tier that served it: the next lookup is a miss, not a hit that
never loads. On a real fs tier (with a cpu tier above it, where lookups promote)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmkv import KVSpec, load_config
from lmkv.engines.local import LocalEngine
from lmkv.memory import tensor_obj
from lmkv.testing.engines import open_local_engine

CHUNK = 32
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
TOKENS = list(range(500, 596))  # 3 whole chunks


def hf_kv(total: int):
    gen = torch.Generator().manual_seed(0)
    shape = (1, SPEC.num_kv_heads, total, SPEC.head_dim)
    return [(torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half())
            for _ in range(SPEC.num_layers)]


def open_engine(root: Path, connector: str) -> LocalEngine:
    overrides = {"lmkv.chunk_size": CHUNK, "lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "4MiB"}},
        {"type": "fs", "options": {"url": str(root / "kv")}}]}
    if connector == "paged":
        overrides["lmkv.gpu_connector"] = "paged"
    return open_local_engine(load_config(env={}, overrides=overrides), SPEC,
                             model_name="misfit-test")


def store(engine: LocalEngine, connector: str) -> int:
    if connector == "hf":
        return engine.store(TOKENS, kv=hf_kv(len(TOKENS)))
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(8, 2, 16, 32, generator=gen).half()
              for _ in range(SPEC.num_layers)]
    return engine.store(TOKENS, kv_caches=caches, block_ids=list(range(6)))


def retrieve(engine: LocalEngine, connector: str) -> int:
    if connector == "hf":
        return engine.retrieve(TOKENS).num_tokens
    caches = [torch.zeros(8, 2, 16, 32).half() for _ in range(SPEC.num_layers)]
    return engine.retrieve(TOKENS, kv_caches=caches, block_ids=list(range(6))).num_tokens


@pytest.mark.parametrize("connector", ["hf", "paged"])
@pytest.mark.parametrize("misfit", [
    torch.zeros(2, 2, CHUNK, 4, 16, dtype=torch.float16),        # other KV heads
    torch.zeros(2, 2, 2 * CHUNK, 2, 16, dtype=torch.float16),    # more tokens than a chunk
    torch.zeros(SPEC.chunk_shape(CHUNK), dtype=torch.float32),   # other dtype
], ids=["heads", "tokens", "dtype"])
def test_a_misfit_frame_is_removed_and_counted_where_it_was_served(
        tmp_path: Path, connector: str, misfit: torch.Tensor) -> None:
    with open_engine(tmp_path, connector) as first:
        assert store(first, connector) == 96
        assert first.storage.flush()
    # A restarted engine: an empty cpu tier over the fs tier's frames, one of which
    # is replaced by a well-formed frame of another shape under the same key.
    with open_engine(tmp_path, connector) as engine:
        cpu, fs = engine.storage.tiers
        key = engine.chunker.chunk(TOKENS).keys[1]
        assert fs.remove(key)
        assert fs.batched_submit_put([key], [tensor_obj(misfit)]).result(timeout=30) == 1
        assert engine.lookup(TOKENS) == 96  # contains alone cannot tell

        assert retrieve(engine, connector) == CHUNK  # loads up to the misfit
        assert engine.counters.spec_mismatches == 1
        assert fs.counters.corrupt_frames == 1
        assert cpu.counters.corrupt_frames == 0  # its copy was a promotion: removed only
        assert not fs.contains(key) and not cpu.contains(key)
        assert engine.lookup(TOKENS) == CHUNK  # a miss from the misfit on
        assert retrieve(engine, connector) == CHUNK
        assert engine.counters.spec_mismatches == 1  # never served again

        # A store puts the right KV back, and every chunk loads.
        assert store(engine, connector) == 64
        assert retrieve(engine, connector) == 96
        assert engine.storage.stats()[0]["entries"] == 3


def test_a_misfit_alone_in_the_first_tier_is_counted_there(tmp_path: Path) -> None:
    with open_engine(tmp_path, "hf") as engine:
        cpu, fs = engine.storage.tiers
        keys = engine.chunker.chunk(TOKENS).keys
        good = tensor_obj(torch.zeros(SPEC.chunk_shape(CHUNK), dtype=SPEC.dtype))
        wrong = tensor_obj(torch.zeros(2, 2, CHUNK, 4, 16, dtype=SPEC.dtype))
        assert cpu.batched_submit_put(keys[:2], [good, wrong]).result() == 2
        assert engine.retrieve(TOKENS).num_tokens == CHUNK
        assert (cpu.counters.corrupt_frames, fs.counters.corrupt_frames) == (1, 0)
        assert engine.lookup(TOKENS) == CHUNK
        for obj in (good, wrong):
            assert obj.ref_count == 1  # nothing leaked, nothing held
