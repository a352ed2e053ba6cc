"""Replays through the real storage manager and tiers: hits, bytes, sizing."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from lmkv.base.errors import LMKVError
from lmkv.config.model import LMKVConfig, load_config
from lmkv.replay.belady import lru_hits
from lmkv.replay.defaults import PHYSICAL_CHUNK_BYTES
from lmkv.replay.run import Progress, frame_bytes, replay, sized_config
from lmkv.replay.trace import load_trace
from tests.plugins.plugin_fixtures import our_plugin_names
from tests.replay.conftest import META

CHUNK = 64 << 20  # a 512-token chunk of Llama-3-8B in bf16


def test_a_shared_prefix_hits_and_bytes_add_up(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    trace = load_trace(str(mooncake([[1, 2, 3], [1, 2, 4]])), meta=META)
    run = replay(trace, LMKVConfig(), "lru", 10, model_chunk_bytes=CHUNK)
    assert (run.hits, run.chunk_requests) == (2, 6)
    assert run.hit_ratio == pytest.approx(2 / 6)
    assert run.chunks_stored == 4 and run.chunks_unstored == 0
    assert run.chunk_ops == 6 + 4
    (tier,) = run.tiers
    assert (tier.type, tier.chunks_written, tier.chunks_read) == ("cpu", 4, 2)


def test_a_hash_id_after_another_prefix_is_a_miss(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    trace = load_trace(str(mooncake([[1, 2, 3], [5, 2, 3]])), meta=META)
    assert replay(trace, LMKVConfig(), "lru", 10, model_chunk_bytes=CHUNK).hits == 0


@pytest.mark.parametrize("seed", range(5))
def test_the_real_lru_tier_matches_the_textbook_simulation(
        mooncake: Callable[[Sequence[Sequence[int]]], Path], seed: int) -> None:
    # One chunk a request: no prefixes, so any LRU (prefix-aware or not) is the textbook one.
    rng = random.Random(seed)
    path = mooncake([[rng.randrange(30)] for _ in range(300)])
    trace = load_trace(str(path), meta=META)
    for capacity in (1, 4, 11):
        run = replay(trace, LMKVConfig(), "lru", capacity, model_chunk_bytes=CHUNK)
        assert run.hits == lru_hits(trace.requests, capacity), capacity


def test_room_for_everything_misses_only_first_sightings(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    rng = random.Random(3)
    stems = [[rng.randrange(50) for _ in range(3)] for _ in range(4)]
    path = mooncake([[*rng.choice(stems), rng.randrange(50)] for _ in range(100)])
    trace = load_trace(str(path), meta=META)
    run = replay(trace, LMKVConfig(), "lru", trace.unique_chunks, model_chunk_bytes=CHUNK)
    assert run.hits == trace.chunk_requests - trace.unique_chunks
    assert run.tiers[0].evictions == 0


def test_a_request_longer_than_the_tier_stores_a_prefix(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    # As an engine's store does: the buffers it holds cannot be evicted for each other.
    trace = load_trace(str(mooncake([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])), meta=META)
    run = replay(trace, LMKVConfig(), "lru", 2, model_chunk_bytes=CHUNK)
    assert run.chunks_stored == 2 and run.chunks_unstored == 3 + 3  # both requests
    assert run.hits == 2


def test_the_first_tier_is_sized_in_physical_chunks() -> None:
    sized = sized_config(LMKVConfig(), "lru", 7, CHUNK)
    assert sized.tiers[0].options["max_bytes"] == 7 * PHYSICAL_CHUNK_BYTES
    assert sized.plugins.tiers[0].backend.options.max_bytes == 7 * PHYSICAL_CHUNK_BYTES


def test_lower_tiers_keep_their_size_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"tiers: [cpu, {{type: fs, options: {{url: '{tmp_path}/fs', "
                    "max_bytes: 1GiB}}]\n")
    config = load_config(path)
    sized = sized_config(config, "lru", 3, CHUNK)
    # 1 GiB / 64 MiB: 16 chunks, each a frame of a 4 KiB chunk in the fs tier
    assert sized.tiers[1].options["max_bytes"] == 16 * frame_bytes(config)
    assert frame_bytes(config) > PHYSICAL_CHUNK_BYTES
    assert [t.eviction.type for t in sized.tiers] == ["lru", "lru"]


@pytest.mark.parametrize("serializer", ["naive", "zstd"])
def test_a_frame_tier_holds_exactly_its_capacity_in_chunks(
        tmp_path: Path, mooncake: Callable[[Sequence[Sequence[int]]], Path],
        serializer: str) -> None:
    trace = load_trace(str(mooncake([[1], [2], [3], [4], [1]])), meta=META)
    for capacity, hits in ((3, 0), (4, 1)):
        config_path = tmp_path / f"c{capacity}{serializer}.yaml"
        config_path.write_text(f"serializer: {serializer}\ntiers: [{{type: fs, options: "
                               f"{{url: '{tmp_path}/fs{capacity}{serializer}', "
                               "durable: false}}]\n")
        run = replay(trace, load_config(config_path), "lru", capacity,
                     model_chunk_bytes=CHUNK)
        assert run.hits == hits, capacity


def test_a_first_tier_without_a_size_is_refused() -> None:
    config = LMKVConfig(tiers=[{"type": "redis"}])  # type: ignore[list-item]
    with pytest.raises(LMKVError, match=r"tier 0 \(redis\) has no max_bytes"):
        sized_config(config, "lru", 3, CHUNK)


def test_two_tiers_write_through_and_leave_nothing_behind(
        tmp_path: Path, mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    config_path = tmp_path / "c.yaml"
    config_path.write_text(f"tiers: [cpu, {{type: fs, options: {{url: '{tmp_path}/fs', "
                           "max_bytes: 10GiB, durable: false}}]\n")
    config = load_config(config_path)
    trace = load_trace(str(mooncake([[1, 2, 3], [1, 2, 4], [9], [1, 2, 3]])), meta=META)
    first = replay(trace, config, "lru", 3, model_chunk_bytes=CHUNK)
    cpu, fs = first.tiers
    assert (cpu.type, fs.type) == ("cpu", "fs")
    assert fs.chunks_written == first.chunks_stored == 5
    # The cpu tier holds three chunks: by the last request, [1, 2, 3] is not all
    # there, and the fs tier serves what it lacks.
    assert first.hits == 2 + 3 and fs.chunks_read >= 1
    again = replay(trace, config, "lru", 3, model_chunk_bytes=CHUNK)  # starts empty again
    assert again.hits == first.hits


def test_progress_goes_to_its_stream_only_when_a_run_is_long() -> None:
    out = io.StringIO()
    quiet = Progress("lru at 5%", 10, stream=out, every_s=3600)
    quiet.update(5)
    assert out.getvalue() == ""
    loud = Progress("lru at 5%", 10, stream=out, every_s=0)
    loud.update(5)
    assert out.getvalue() == "lmkv replay: lru at 5%: 5/10 requests\n"


def test_a_tier_that_already_holds_chunks_is_refused(
        tmp_path: Path, mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    import torch

    from lmkv.memory import release
    from lmkv.storage.manager import StorageManager

    config_path = tmp_path / "c.yaml"
    config_path.write_text(f"tiers: [{{type: fs, options: {{url: '{tmp_path}/fs', "
                           "durable: false}}]\n")
    config = load_config(config_path)
    trace = load_trace(str(mooncake([[1, 2]])), meta=META)
    storage = StorageManager.from_config(config)  # someone else's chunk, left there
    obj = storage.allocate((PHYSICAL_CHUNK_BYTES,), torch.uint8)
    storage.put([trace.keys[0]], [obj]).result()
    release([obj])
    storage.close()
    with pytest.raises(LMKVError, match=r"tier 0 \(fs\) already holds chunks"):
        replay(trace, config, "lru", 2, model_chunk_bytes=CHUNK)


@pytest.mark.parametrize("policy", our_plugin_names("eviction_policy"))
def test_no_installed_policy_passes_belady(
        mooncake: Callable[[Sequence[Sequence[int]]], Path], policy: str) -> None:
    # Shared stems plus random tails, as prompts with a common system prompt are.
    from lmkv.replay.belady import belady_hits

    total = 0
    for seed in range(6):
        rng = random.Random(seed)
        stems = [[rng.randrange(1000) for _ in range(rng.randint(1, 4))] for _ in range(6)]
        path = mooncake([[*rng.choice(stems), *(rng.randrange(40) for _ in range(
            rng.randint(0, 4)))] for _ in range(60)])
        trace = load_trace(str(path), meta=META)
        for capacity in (2, 5, 13):
            run = replay(trace, LMKVConfig(), policy, capacity, model_chunk_bytes=CHUNK)
            assert run.hits <= belady_hits(trace.requests, capacity), (seed, capacity)
            total += run.hits
    assert total > 0
