"""Server mode: a well-formed frame of the wrong shape under the right key is removed
from the server's tiers and counted as corrupt, as in process
(tests/engines/test_misfit_frames.py): the next lookup of any client is a miss,
not a hit that never loads. A real ``lmkv server`` over a real fs tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmkv import KVSpec, load_config
from lmkv.engines import open_engine
from lmkv.engines.remote import RemoteEngine
from lmkv.memory import tensor_obj
from lmkv.testing.engines import open_local_engine
from tests.server.procs import start_server

pytestmark = pytest.mark.slow  # real lmkv server processes

CHUNK = 32
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
TOKENS = list(range(700, 796))  # 3 whole chunks
MODEL = "remote-misfit-test"
MISFITS = {
    "heads": torch.zeros(2, 2, CHUNK, 4, 16, dtype=torch.float16),
    "tokens": torch.zeros(2, 2, 2 * CHUNK, 2, 16, dtype=torch.float16),  # more than a chunk
    "dtype": torch.zeros(SPEC.chunk_shape(CHUNK), dtype=torch.float32),
}


def tiers(root: Path) -> list[dict]:
    return [{"type": "cpu", "options": {"max_bytes": "4MiB"}},
            {"type": "fs", "options": {"url": str(root / "kv")}}]


def server_yaml(root: Path) -> str:
    return (f"tiers:\n  - type: cpu\n    options: {{max_bytes: 4MiB}}\n"
            f"  - type: fs\n    options: {{url: '{root / 'kv'}'}}\n")


def hf_kv(total: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (1, SPEC.num_kv_heads, total, SPEC.head_dim)
    return [(torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half())
            for _ in range(SPEC.num_layers)]


def paged_caches(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(8, 2, 16, 32).half() for _ in range(SPEC.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 2, 16, 32, generator=gen).half() for _ in range(SPEC.num_layers)]


def overrides(connector: str, block_size: int | None = None) -> dict:
    extra = {"lmkv.block_size": block_size} if block_size else {}
    return {"lmkv.gpu_connector": "paged", **extra} if connector == "paged" else extra


def write_behind_its_back(root: Path, connector: str, misfit: torch.Tensor,
                          block_size: int | None = None) -> None:
    """The fs tier's frames of TOKENS, stored in process, with chunk 1's replaced by a
    well-formed frame of another shape under the same key (before the server starts:
    it finds the directory's entries when it starts)."""
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK, "lmkv.tiers": tiers(root),
                                            **overrides(connector, block_size)})
    with open_local_engine(config, SPEC, model_name=MODEL) as engine:
        assert store(engine, connector) == 3 * CHUNK
        assert engine.storage.flush()
        fs = engine.storage.tiers[1]
        key = engine.chunker.chunk(TOKENS).keys[1]
        assert fs.remove(key)
        assert fs.batched_submit_put([key], [tensor_obj(misfit)]).result(timeout=30) == 1


def remote(address: str, connector: str, block_size: int | None = None) -> RemoteEngine:
    config = load_config(env={}, overrides={
        "lmkv.mode": "server", "lmkv.chunk_size": CHUNK, "lmkv.server.address": address,
        "lmkv.server.timeout_ms": 10_000, **overrides(connector, block_size)})
    engine = open_engine(config, SPEC, model_name=MODEL)
    assert isinstance(engine, RemoteEngine)
    return engine


def store(engine, connector: str) -> int:
    if connector == "hf":
        return engine.store(TOKENS, kv=hf_kv(len(TOKENS)))
    return engine.store(TOKENS, kv_caches=paged_caches(0), block_ids=list(range(6)))


def retrieve(engine, connector: str) -> tuple[int, list[torch.Tensor]]:
    """Tokens loaded, and the KV they were loaded into (per layer, K then V)."""
    if connector == "hf":
        got = engine.retrieve(TOKENS)
        return got.num_tokens, [t for pair in got.kv or () for t in pair]
    caches = paged_caches(None)
    return engine.retrieve(TOKENS, kv_caches=caches, block_ids=list(range(6))).num_tokens, caches


def same_kv(connector: str, kv: list[torch.Tensor]) -> bool:
    """Whether ``kv`` is the KV ``store`` stored (the paged caches' 6 blocks of it)."""
    if connector == "hf":
        want = [t for pair in hf_kv(len(TOKENS)) for t in pair]
    else:
        kv, want = [c[:6] for c in kv], [c[:6] for c in paged_caches(0)]
    return len(kv) == len(want) and all(torch.equal(a, b) for a, b in zip(kv, want,
                                                                          strict=True))


def fs_row(engine: RemoteEngine) -> dict:
    return engine.client.stats().tiers[1]


@pytest.mark.parametrize("connector,misfit", [
    ("hf", "heads"), ("hf", "tokens"), ("hf", "dtype"), ("paged", "heads")])
def test_a_misfit_is_removed_from_the_server_and_counted_once(
        tmp_path: Path, connector: str, misfit: str) -> None:
    write_behind_its_back(tmp_path, connector, MISFITS[misfit])
    server = start_server(tmp_path, server_yaml(tmp_path))
    try:
        with remote(server.address, connector) as engine, \
                remote(server.address, connector) as other:
            key = engine.chunker.chunk(TOKENS).keys[1]
            assert engine.lookup(TOKENS) == 3 * CHUNK  # contains alone cannot tell
            assert retrieve(engine, connector)[0] == CHUNK  # loads up to the misfit
            assert engine.counters.spec_mismatches == 1

            stats = engine.client.stats()
            cpu, fs = stats.tiers
            assert (stats.server.dropped_misfits, stats.server.refused_drops) == (1, 0)
            assert fs["corrupt_frames"] == 1 and cpu["corrupt_frames"] == 0
            assert fs["entries"] == 2  # its frame is gone from the disk tier
            assert engine.client.lookup([key], [CHUNK]) == 0  # and from every tier

            assert other.lookup(TOKENS) == CHUNK  # another client misses there
            assert retrieve(engine, connector)[0] == CHUNK
            assert engine.counters.spec_mismatches == 1  # never served again

            # A store puts the right KV back, and every chunk loads, bit-identical.
            # Chunk 1, and chunk 2 unless the reads promoted it to memory (then it is held).
            assert store(other, connector) in (CHUNK, 2 * CHUNK)
            loaded, kv = retrieve(engine, connector)
            assert loaded == 3 * CHUNK and same_kv(connector, kv)
            assert engine.counters.spec_mismatches == 1
            assert fs_row(engine)["corrupt_frames"] == 1
            assert engine.client.stats().server.dropped_misfits == 1
            assert engine.client.counters.error_replies == 0
    finally:
        assert server.stop() == 0, server.log()


def test_a_misfit_served_as_a_partial_hit_is_dropped_under_the_key_it_was_served(
        tmp_path: Path) -> None:
    """Block-granular hits: a prompt that leaves TOKENS inside chunk 1 hits that chunk's
    leading blocks through their aliases; the chunk they lead is the misfit. The
    alias the hit was served under is the entry dropped (as in process): the next
    lookup no longer reaches into that chunk through it."""
    write_behind_its_back(tmp_path, "hf", MISFITS["heads"], block_size=8)
    other_prompt = TOKENS[:48] + list(range(9000, 9048))  # leaves TOKENS 2 blocks into chunk 1
    server = start_server(tmp_path, server_yaml(tmp_path))
    try:
        with remote(server.address, "hf", block_size=8) as engine:
            assert engine.lookup(other_prompt) == 48
            assert engine.retrieve(other_prompt).num_tokens == CHUNK
            assert engine.counters.spec_mismatches == 1
            stats = engine.client.stats()
            assert stats.server.dropped_misfits == 1 and stats.tiers[1]["corrupt_frames"] == 1
            # The alias of the 2 blocks is gone; that of the first block still leads
            # to the chunk, and goes the same way when it is served.
            assert engine.lookup(other_prompt) == 40
            assert engine.retrieve(other_prompt).num_tokens == CHUNK
            assert engine.client.stats().server.dropped_misfits == 2
            assert engine.lookup(other_prompt) == CHUNK
    finally:
        assert server.stop() == 0, server.log()
