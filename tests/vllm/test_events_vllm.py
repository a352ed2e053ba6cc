"""KV events of lmkv's tiers (lmkv/integrations/vllm/events.py) against a real
worker engine (cpu tier) and vLLM's own event classes; the stream a real
``vllm serve`` publishes is checked by tests/vllm/e2e_events.py.

Runs in the vLLM venv; skipped where vLLM is not installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from lmkv.config.model import load_config
from lmkv.integrations.vllm.events import (
    LMKVKVEvents,
    SchedulerEvents,
    WorkerEvents,
    block_names,
    medium_names,
)
from lmkv.integrations.vllm.specs import BlockNames, StoreSpec
from lmkv.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.vllm

LAYERS, HEADS, DIM, BLOCK, BLOCKS, CHUNK = 2, 2, 8, 16, 8, 32
CHUNK_BYTES = LAYERS * 2 * HEADS * DIM * CHUNK * 4  # float32


def worker(tmp_path, chunks_in_tier: int) -> WorkerSide:  # type: ignore[no-untyped-def]
    config = load_config(env={}, overrides={
        "lmkv.chunk_size": CHUNK, "lmkv.lookup.runtime_dir": str(tmp_path),
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": chunks_in_tier * CHUNK_BYTES}}]})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", max_model_len=256, get_head_size=lambda: DIM),
        parallel_config=SimpleNamespace(world_size=1, rank=0),
        kv_transfer_config=SimpleNamespace(engine_id="ev"),
        cache_config=SimpleNamespace(block_size=BLOCK))
    side = WorkerSide(config, vllm_config)
    side.register({f"layer.{i}": torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM)
                   for i in range(LAYERS)})
    return side


def store(side: WorkerSide, events: WorkerEvents, tokens: list[int],
          hashes: list[int]) -> LMKVKVEvents | None:
    """What the connector does with one store plan: name it, store it, take the events."""
    spec = StoreSpec("r", tokens, list(range(len(tokens) // BLOCK)),
                     blocks=BlockNames(hashes))
    events.name([spec])
    side._store(spec)
    return events.take()


def summary(batch: LMKVKVEvents | None) -> list[tuple]:
    out = []
    for e in batch.get_all_events() if batch is not None else []:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, e.block_hashes, e.parent_block_hash,
                        len(e.token_ids), e.block_size))
        else:
            assert isinstance(e, BlockRemoved)
            out.append(("removed", e.medium, e.block_hashes))
    return out


def test_a_stored_chunk_is_its_blocks_stored_and_an_evicted_one_removed(tmp_path) -> None:
    side = worker(tmp_path, chunks_in_tier=2)
    events = WorkerEvents.attach(side.engine, BLOCK)
    try:
        a = list(range(100, 164))  # two chunks, four blocks
        got = store(side, events, a, [1, 2, 3, 4])
        assert summary(got) == [("stored", "lmkv:cpu", [1, 2], None, CHUNK, BLOCK),
                                ("stored", "lmkv:cpu", [3, 4], 2, CHUNK, BLOCK)]
        first = got.get_all_events()[0]
        assert first.token_ids == a[:CHUNK] and first.group_idx == 0
        # Another prompt of two chunks: its buffers evict the first one's chunks,
        # tail first (a tier never orphans a prefix), then it is stored.
        got = store(side, events, list(range(500, 564)), [5, 6, 7, 8])
        assert summary(got) == [("removed", "lmkv:cpu", [3, 4]),
                                ("removed", "lmkv:cpu", [1, 2]),
                                ("stored", "lmkv:cpu", [5, 6], None, CHUNK, BLOCK),
                                ("stored", "lmkv:cpu", [7, 8], 6, CHUNK, BLOCK)]
        assert events.take() is None  # nothing changed since
    finally:
        events.close()
        side.close()


def test_blocks_two_stored_chunks_share_are_removed_with_the_last(tmp_path) -> None:
    """A block-aligned partial chunk (vLLM hits at the block) and the whole chunk
    that later extends it share a block: announced once, removed when the last goes."""
    side = worker(tmp_path, chunks_in_tier=8)
    events = WorkerEvents.attach(side.engine, BLOCK)
    try:
        tokens = list(range(300, 364))
        assert summary(store(side, events, tokens[:48], [1, 2, 3])) == [
            ("stored", "lmkv:cpu", [1, 2], None, CHUNK, BLOCK),
            ("stored", "lmkv:cpu", [3], 2, BLOCK, BLOCK)]
        assert summary(store(side, events, tokens, [1, 2, 3, 4])) == [
            ("stored", "lmkv:cpu", [4], 3, BLOCK, BLOCK)]  # block 3 was there already
        chunks = side.engine.chunker.chunk(tokens[:48])
        tier = side.engine.storage.tiers[0]
        assert tier.remove(chunks.keys[1])  # the partial chunk: block 3 stays stored
        assert events.take() is None
        assert tier.remove(side.engine.chunker.chunk(tokens).keys[1])
        assert summary(events.take()) == [("removed", "lmkv:cpu", [3, 4])]
    finally:
        events.close()
        side.close()


def test_a_chunk_that_falls_out_of_the_map_is_announced_removed(tmp_path) -> None:
    side = worker(tmp_path, chunks_in_tier=8)
    events = WorkerEvents(side.engine.storage, side.engine.chunker, BLOCK, map_chunks=2)
    try:
        store(side, events, list(range(64)), [1, 2, 3, 4])
        got = store(side, events, list(range(700, 732)), [9, 10])
        assert summary(got) == [("removed", "lmkv:cpu", [1, 2]),
                                ("stored", "lmkv:cpu", [9, 10], None, CHUNK, BLOCK)]
        tier = side.engine.storage.tiers[0]
        keys = side.engine.chunker.chunk(list(range(64))).keys
        assert tier.remove(keys[1])  # still in the map: removed
        assert summary(events.take()) == [("removed", "lmkv:cpu", [3, 4])]
        assert tier.remove(keys[0])  # out of the map, announced removed already
        assert events.take() is None
    finally:
        events.close()
        side.close()


def test_a_store_without_names_publishes_nothing_and_close_stops_watching(tmp_path) -> None:
    side = worker(tmp_path, chunks_in_tier=4)
    events = WorkerEvents.attach(side.engine, BLOCK)
    policy = side.engine.storage.tiers[0].context.eviction_policy
    try:
        spec = StoreSpec("r", list(range(64)), [0, 1, 2, 3])  # vLLM publishes no events
        events.name([spec])
        side._store(spec)
        assert events.take() is None
    finally:
        events.close()
        side.close()
    assert policy._watcher is None


def test_medium_names() -> None:
    assert medium_names(["cpu", "fs"]) == ["lmkv:cpu", "lmkv:fs"]
    assert medium_names(["CPU", "fs", "fs"]) == ["lmkv:cpu", "lmkv:fs:1", "lmkv:fs:2"]


def test_block_names_are_the_hashes_vllm_publishes() -> None:
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    request = SimpleNamespace(block_hashes=hashes, lora_request=None, mm_features=[],
                              cache_salt=None, prompt_embeds=None)
    names = block_names(request, 3 * BLOCK + 5, BLOCK)
    assert names.hashes == [maybe_convert_block_hash(h) for h in hashes[:3]]
    assert names.extra_keys is None and names.lora_id is None
    assert block_names(request, BLOCK - 1, BLOCK) is None
    request.cache_salt = "tenant-a"  # vLLM's extra key of a salted prompt's first block
    assert block_names(request, 2 * BLOCK, BLOCK).extra_keys == [("tenant-a",), None]


def test_the_scheduler_waits_for_every_worker_to_store_and_for_one_to_remove() -> None:
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[0] * 32,
                         block_size=16, lora_id=None, medium="lmkv:cpu", lora_name=None)
    removed = BlockRemoved(block_hashes=[1, 2], medium="lmkv:cpu")
    sched = SchedulerEvents(world_size=2)
    sched.collect(LMKVKVEvents([stored]))
    assert sched.take() == []
    sched.collect(LMKVKVEvents([stored]))
    assert sched.take() == [stored]
    sched.collect(LMKVKVEvents([removed]))
    assert sched.take() == [removed]
    sched.collect(LMKVKVEvents([removed]))  # the other worker's: published once
    assert sched.take() == []
    sched.collect(LMKVKVEvents([stored]))  # one worker stored it, then the other evicted
    sched.collect(LMKVKVEvents([removed]))
    sched.collect(LMKVKVEvents([stored]))  # the first worker's late store: not all have it
    assert sched.take() == [removed]
    single = SchedulerEvents(world_size=1)
    single.collect(LMKVKVEvents([stored, removed]))
    single.collect(None)
    assert single.take() == [stored, removed]
