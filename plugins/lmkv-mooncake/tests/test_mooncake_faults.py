"""Faults against a real master: killed and restarted mid-run, foreign values,
segments left behind, the client package missing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmkv.contracts import BackendContext, CacheKey, KeyMeta, MemoryAllocator, tensor_obj
from lmkv.testing.mooncake import MooncakeMaster, require_mooncake
from lmkv.testing.tiers import serializer

pytestmark = pytest.mark.slow  # a real mooncake_master

META = KeyMeta("faults-model", 1, 0, "float16", "l2thd")


def key(i: int) -> CacheKey:
    return CacheKey(META, i.to_bytes(4, "little") * 8)


def chunk(i: int) -> torch.Tensor:
    return torch.randn((2, 2, 16, 2, 32), generator=torch.Generator().manual_seed(i)).half()


def put(tier: object, ids: list[int]) -> int:
    objs = [tensor_obj(chunk(i)) for i in ids]
    return tier.batched_submit_put([key(i) for i in ids], objs).result(timeout=60)


def read(tier: object, i: int) -> torch.Tensor | None:
    obj = tier.get_blocking(key(i))
    if obj is None:
        return None
    try:
        return obj.tensor.clone()
    finally:
        obj.ref_down()


def eventually(condition: object, deadline_s: float = 60.0) -> bool:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture
def own_master(tmp_path: Path) -> MooncakeMaster:
    require_mooncake()
    master = MooncakeMaster(tmp_path / "master").start()
    yield master
    master.stop()


def misses_then_recovery(tier: object, kill: Callable[[], None],
                         restart: Callable[[], None]) -> None:
    """Store, ``kill`` the service, check every call is a miss or a dropped write
    (nothing raises), ``restart`` it empty, check the tier serves again by
    itself and never answers wrong KV."""
    assert put(tier, [1, 2, 3]) == 3
    assert torch.equal(read(tier, 1), chunk(1))

    kill()
    before = tier.stats()
    assert tier.batched_async_contains("l", [key(1), key(2)]) == 0
    assert read(tier, 2) is None
    assert tier.batched_get_non_blocking("l", [key(1), key(2)]).result(timeout=60) == []
    assert put(tier, [4]) == 0
    tier.remove(key(3))
    during = tier.stats()
    assert during["errors"] > before["errors"]
    assert during["dropped_writes"] >= before["dropped_writes"] + 1
    assert during["hits"] == before["hits"]

    restart()  # same ports, empty: what it held is gone
    assert eventually(lambda: put(tier, [5]) == 1), "the tier did not recover"
    assert torch.equal(read(tier, 5), chunk(5))
    assert tier.batched_async_contains("l", [key(5)]) == 1
    for i in (1, 2, 3, 4):  # lost with the old state: misses, never wrong KV
        got = read(tier, i)
        assert got is None or torch.equal(got, chunk(i))


def reads_prefix(tier: object, asked: int, found: int, allocator: object = None) -> None:
    """A batched get of keys 0 to ``asked`` - 1 answers chunks 0 to ``found`` - 1,
    each its own (from ``allocator`` when given); all released after."""
    objs = tier.batched_get_non_blocking("l", [key(i) for i in range(asked)]).result(timeout=60)
    try:
        assert len(objs) == found
        for i, obj in enumerate(objs):
            assert torch.equal(obj.tensor, chunk(i))
            assert allocator is None or obj.allocator is allocator
    finally:
        for obj in objs:
            obj.ref_down()


def test_a_master_killed_and_restarted_means_misses_then_recovery(
        own_master: MooncakeMaster, make_tier: object) -> None:
    misses_then_recovery(make_tier(own_master), own_master.kill, own_master.start)


@pytest.mark.parametrize("value", [b"not an lmkv frame at all", b"LMKV" + bytes(200), b"x"])
def test_a_foreign_value_is_a_miss_and_is_removed(make_tier: object, shared_client: None,
                                                  value: bytes) -> None:
    tier = make_tier()
    with tier.link.using() as store:
        assert store.put(tier.store_key(key(7)), value) == 0
    assert tier.contains(key(7))
    assert read(tier, 7) is None
    assert tier.stats()["corrupt_frames"] == 1
    assert not tier.contains(key(7))


def test_a_closed_tier_leaves_no_segment_mounted(mooncake_master: MooncakeMaster,
                                                 shared_client: None) -> None:
    from mooncake_helpers import new_tier

    from lmkv_mooncake.client import join_closing

    before = mooncake_master.mounted_bytes()
    tier = new_tier(mooncake_master, global_segment_size="16MiB")  # its own client
    assert put(tier, [1]) == 1
    assert mooncake_master.mounted_bytes() == before + (16 << 20)
    tier.close()
    assert join_closing(30)
    assert eventually(lambda: mooncake_master.mounted_bytes() == before, 10)


def test_without_the_client_package_the_error_is_one_line_naming_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lmkv_mooncake.client import MooncakeMissing, store_class

    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MooncakeMissing) as info:
        store_class()
    message = str(info.value)
    assert "\n" not in message
    assert "mooncake-transfer-engine-non-cuda" in message
    assert "mooncake-transfer-engine " in message


def test_options_forbid_unknown_fields_and_check_addresses() -> None:
    from pydantic import ValidationError

    from lmkv_mooncake import MooncakeOptions

    with pytest.raises(ValidationError, match="extra"):
        MooncakeOptions(master="127.0.0.1:1")
    with pytest.raises(ValidationError, match="host:port"):
        MooncakeOptions(master_address="127.0.0.1")
    with pytest.raises(ValidationError, match="metadata"):
        MooncakeOptions(metadata_server="127.0.0.1:8080")
    with pytest.raises(ValidationError):
        MooncakeOptions(protocol="udp")
    assert MooncakeOptions(master_address="etcd://10.0.0.1:2379").protocol == "tcp"


def test_addresses_default_to_mooncakes_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmkv_mooncake import MooncakeOptions

    monkeypatch.setenv("MOONCAKE_MASTER", "10.1.2.3:50051")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    options = MooncakeOptions()
    assert options.master_address == "10.1.2.3:50051" and options.protocol == "rdma"


def test_direct_gets_check_every_frame_and_fall_back_on_another_layout(
        make_tier: object, shared_client: None) -> None:
    tier = make_tier()
    assert put(tier, [1, 2, 3]) == 3
    assert torch.equal(read(tier, 1), chunk(1))  # staged: learns the layout
    assert torch.equal(read(tier, 2), chunk(2))  # straight into the arena
    assert tier.stats()["direct_gets"] == 1

    other = torch.arange(64, dtype=torch.float32).reshape(4, 16)  # another shape and dtype
    assert tier.batched_submit_put([key(9)], [tensor_obj(other)]).result(timeout=60) == 1
    objs = tier.batched_get_non_blocking("l", [key(3), key(9)]).result(timeout=60)
    try:
        assert [tuple(o.shape) for o in objs] == [tuple(chunk(3).shape), (4, 16)]
        assert torch.equal(objs[0].tensor, chunk(3)) and torch.equal(objs[1].tensor, other)
    finally:
        for obj in objs:
            obj.ref_down()

    assert torch.equal(read(tier, 1), chunk(1))  # relearn the chunk layout
    with tier.link.using() as store:  # flip a payload bit behind the tier's back
        name = tier.store_key(key(2))
        frame = bytearray(store.get(name))
        frame[-3] ^= 1
        assert store.remove(name, True) == 0 and store.put(name, bytes(frame)) == 0
    direct = tier.stats()["direct_gets"]
    assert read(tier, 2) is None
    stats = tier.stats()
    assert stats["corrupt_frames"] == 1 and stats["direct_gets"] == direct
    assert not tier.contains(key(2))


def test_pipelined_windows_put_and_get_every_chunk_and_give_back_the_rest(
        make_tier: object, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of one chunk: puts frame the next while one is sent, direct gets
    fetch the next while one is checked; a read that stops early releases the
    window fetched past it."""
    import lmkv_mooncake.backend
    import lmkv_mooncake.writer

    monkeypatch.setattr(lmkv_mooncake.writer, "PIPELINE_BYTES", 1)
    monkeypatch.setattr(lmkv_mooncake.backend, "PIPELINE_BYTES", 1)
    tier = make_tier()
    assert put(tier, [0, 1, 2, 4, 5]) == 5
    assert torch.equal(read(tier, 0), chunk(0))  # learns the layout
    arena = tier.context.allocate.__self__
    used = arena.used_bytes
    reads_prefix(tier, 6, 3)
    assert tier.stats()["direct_gets"] == 3
    assert arena.used_bytes == used  # the window fetched past key 3 was given back


def test_pipelined_staged_gets_stop_at_the_first_missing_and_give_back_the_rest(
        mooncake_master: MooncakeMaster, shared_client: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A serializer without a raw payload reads staged, through Mooncake's local
    buffer: windows of one key, the next fetched while one is decoded; a read
    that stops early gives back the window fetched past it (twenty reads would
    exhaust the buffer otherwise)."""
    import uuid

    from lmkv_mooncake import MooncakeBackend, MooncakeOptions

    monkeypatch.setattr(MooncakeBackend, "_window", lambda self: 2)  # windows of one key
    arena = MemoryAllocator(16 << 20, pin_memory=False)
    tier = MooncakeBackend(
        MooncakeOptions(**mooncake_master.options(key_prefix=f"z-{uuid.uuid4().hex[:8]}:",
                                                  local_buffer_size="1MiB")),
        BackendContext(serializer=serializer("zstd"), allocate=arena.allocate))
    try:
        assert put(tier, [0, 1, 2, 4, 5]) == 5
        for _ in range(20):
            reads_prefix(tier, 6, 3)
            assert arena.used_bytes == 0
        assert tier.stats()["errors"] == 0 and tier.stats()["direct_gets"] == 0
    finally:
        tier.close()
