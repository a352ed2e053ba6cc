"""The tier as a thin client of a ``mooncake_client`` (``client_address``):
Mooncake's standalone real client holds the segment and the master connection,
the tier moves frames through memory it maps from it. Against a real master and
a real ``mooncake_client`` on loopback.

Runs in a pytest process of its own (``test_mooncake_real_client.py`` starts
it): Mooncake 0.3.13 aborts when thin and embedded clients share a process,
which the tier refuses, and the rest of this suite makes embedded ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mooncake_engine_worker import TOKENS, hf_kv
from mooncake_servers import (
    MOONCAKE_CLIENT,
    MooncakeMaster,
    MooncakeRealClient,
    new_tier,
    require_mooncake,
)
from test_mooncake_faults import chunk, eventually, key, put, read

from lmkv import StorageBackend
from lmkv.memory import tensor_obj
from lmkv.testing import StorageBackendConformance
from lmkv.tokens import CacheKey

WORKER = Path(__file__).with_name("mooncake_engine_worker.py")


def _require_real_client() -> None:
    require_mooncake()
    if MOONCAKE_CLIENT is None:  # shipped with the same wheels as mooncake_master
        pytest.fail("mooncake_client is not installed beside mooncake_master")


@pytest.fixture(scope="module")
def real_client(mooncake_master: MooncakeMaster,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeRealClient]:
    _require_real_client()
    client = MooncakeRealClient(mooncake_master, tmp_path_factory.mktemp("real-client")).start()
    yield client
    client.stop()


class TestMooncakeRealClient(StorageBackendConformance):
    client: MooncakeRealClient

    @pytest.fixture(autouse=True)
    def _client(self, real_client: MooncakeRealClient) -> None:
        self.client = real_client

    def make_backend(self) -> StorageBackend:
        return new_tier(self.client)

    def corrupt_entry(self, backend: StorageBackend, key: CacheKey) -> bool:
        """Flip a payload bit, with the store's own client (get, remove, put)."""
        store, name = _own_store(backend), backend.store_key(key)
        frame = bytearray(store.get(name))
        frame[-10] ^= 1
        assert store.remove(name, True) == 0
        assert store.put(name, bytes(frame)) == 0
        return True

    def copy_entry(self, backend: StorageBackend, source: CacheKey, target: CacheKey) -> bool:
        store = _own_store(backend)
        frame = store.get(backend.store_key(source))
        store.remove(backend.store_key(target), True)
        assert store.put(backend.store_key(target), frame) == 0
        return True


def _own_store(backend: StorageBackend) -> object:
    with backend.link.using() as store:  # the tier's own client, behind its back
        return store


@pytest.fixture
def own_real_client(tmp_path: Path) -> Iterator[MooncakeRealClient]:
    """A master and a real client of this test's own: a killed real client's
    segment stays on its master's books for the master's client TTL, and puts
    the master places there fail meanwhile."""
    _require_real_client()
    master = MooncakeMaster(tmp_path / "master").start()
    client = MooncakeRealClient(master, tmp_path / "real-client").start()
    yield client
    client.stop()
    master.stop()


def test_a_real_client_killed_and_restarted_means_misses_then_recovery(
        own_real_client: MooncakeRealClient, make_tier: object) -> None:
    tier = make_tier(own_real_client)
    assert put(tier, [1, 2, 3]) == 3
    assert torch.equal(read(tier, 1), chunk(1))
    assert tier.stats()["direct_gets"] == 0  # it cannot write into lmkv's arena

    own_real_client.kill()  # the segment, and every entry in it, is gone
    before = tier.stats()
    assert tier.batched_async_contains("l", [key(1), key(2)]) == 0
    assert read(tier, 2) is None
    assert tier.batched_get_non_blocking("l", [key(1), key(2)]).result(timeout=60) == []
    assert put(tier, [4]) == 0
    tier.remove(key(3))
    during = tier.stats()
    assert during["errors"] > before["errors"]
    assert during["hits"] == before["hits"]

    own_real_client.start()  # same port, an empty segment
    assert eventually(lambda: put(tier, [5]) == 1), "the tier did not recover"
    assert torch.equal(read(tier, 5), chunk(5))
    assert tier.batched_async_contains("l", [key(5)]) == 1
    for i in (1, 2, 3, 4):  # lost with the old segment: misses, never wrong KV
        got = read(tier, i)
        assert got is None or torch.equal(got, chunk(i))


def _worker(mode: str, client: MooncakeRealClient, out: Path) -> dict:
    options = client.options(key_prefix="real-procs:")
    proc = subprocess.run([sys.executable, str(WORKER), mode, json.dumps(options), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_engine_processes_share_kv_through_the_hosts_real_client(
        own_real_client: MooncakeRealClient, tmp_path: Path) -> None:
    # This process holds no store at all: the KV lives in the real client's
    # segment, so it outlives the engine that stored it.
    stored = _worker("store", own_real_client, tmp_path / "a.json")
    assert stored["lookup_before"] == 0 and stored["stored"] == 256 and stored["flushed"]
    assert stored["tiers"][1]["puts"] == 8

    got = _worker("retrieve", own_real_client, tmp_path / "b.json")
    assert got["lookup_before"] == 256
    assert got["retrieved"] == 256
    cpu, remote = got["tiers"]
    assert cpu["hits"] == 0 and remote["hits"] == 8 and remote["corrupt_frames"] == 0
    expected = hf_kv(len(TOKENS))
    retrieved = torch.load(tmp_path / "b.json.kv")
    for (k, v), (rk, rv) in zip(expected, retrieved, strict=True):
        assert torch.equal(rk[0], k[0, :, :256]) and torch.equal(rv[0], v[0, :, :256])


def test_without_a_real_client_the_tier_starts_and_answers_misses(
        mooncake_master: MooncakeMaster, make_tier: object, tmp_path: Path) -> None:
    never_started = MooncakeRealClient(mooncake_master, tmp_path / "none")
    started = time.monotonic()
    tier = make_tier(never_started, connect_timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert tier.batched_async_contains("l", [key(1)]) == 0
    assert read(tier, 1) is None
    assert put(tier, [1]) == 0


@pytest.mark.parametrize(("options", "expected"), [
    ("{client_address: 127.0.0.1:50052, master_address: 10.0.0.1:50051}",
     ["config key 'tiers.1.options.master_address' = '10.0.0.1:50051' (from {file}): with "
      "client_address set, the mooncake_client's --master_server_address sets this: set it "
      "there, not here"]),
    ("{client_address: 127.0.0.1:50052, global_segment_size: 1GiB, protocol: rdma}",
     ["'tiers.1.options.protocol' = 'rdma' (from {file}): with client_address set, the "
      "mooncake_client's --protocol sets this",
      "'tiers.1.options.global_segment_size' = '1GiB' (from {file}): with client_address "
      "set, the mooncake_client's --global_segment_size sets this"]),
    ("{client_address: 'localhost'}", ["'tiers.1.options.client_address'"]),
    ("{client_address: '127.0.0.1:70000'}", ["must be host:port (port 1-65535) of a "
                                             "mooncake_client on this host, or empty"]),
])
def test_bad_real_client_options_are_one_line_each_at_start(
        tmp_path: Path, options: str, expected: list[str]) -> None:
    import os

    config = tmp_path / "c.yaml"
    config.write_text("tiers: [{type: cpu, options: {max_bytes: 1MiB}}, "
                      f"{{type: mooncake, options: {options}}}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMKV_", "MOONCAKE_"))}
    done = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(config)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == len(expected), done.stderr
    for want in expected:
        want = want.replace("{file}", str(config))
        assert any(want in line for line in lines), (want, lines)


def test_an_override_the_real_client_owns_is_named_with_its_variable(tmp_path: Path) -> None:
    import os

    config = tmp_path / "c.yaml"
    config.write_text("tiers: [{type: cpu, options: {max_bytes: 1MiB}}, "
                      "{type: mooncake, options: {client_address: '127.0.0.1:50052'}}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMKV_", "MOONCAKE_"))}
    env["LMKV_TIERS__1__OPTIONS__LOCAL_HOSTNAME"] = "10.0.0.5"
    done = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(config)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "lmkv: error: config key 'tiers.1.options.local_hostname' = '10.0.0.5' (from env "
        "LMKV_TIERS__1__OPTIONS__LOCAL_HOSTNAME): with client_address set, the "
        "mooncake_client's --host sets this: set it there, not here"]


def test_a_thin_tiers_dump_leaves_out_what_the_real_client_owns(tmp_path: Path) -> None:
    from lmkv_mooncake import MooncakeOptions
    from lmkv_mooncake.options import REAL_CLIENT_FIELDS

    dumped = MooncakeOptions(client_address="127.0.0.1:50052").model_dump()
    assert dumped["client_address"] == "127.0.0.1:50052"
    assert not set(REAL_CLIENT_FIELDS) & set(dumped)
    assert MooncakeOptions(**dumped) == MooncakeOptions(client_address="127.0.0.1:50052")
    assert "master_address" in MooncakeOptions().model_dump()  # embedded: all of them


def test_an_embedded_tier_in_a_process_with_a_thin_client_is_one_line(
        real_client: MooncakeRealClient, make_tier: object) -> None:
    from lmkv.errors import ConfigError

    make_tier(real_client)  # this process's clients are thin ones
    with pytest.raises(ConfigError) as refused:
        make_tier(real_client.master)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("config key 'tiers.0.options.client_address': this process "
                              "already made a Mooncake client of the other kind")
    assert "give every mooncake tier of a process client_address, or none" in message


def test_mooncakes_environment_defaults_are_not_the_tiers_to_refuse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's MOONCAKE_MASTER (for its embedded clients) does not stop a thin
    client of the real client: only options given here are refused."""
    from lmkv_mooncake import MooncakeOptions

    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    options = MooncakeOptions(client_address="127.0.0.1:50052")
    assert options.client_address == "127.0.0.1:50052"


def test_thin_gets_go_window_by_window_and_read_another_layout_alone(
        real_client: MooncakeRealClient, make_tier: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames land in the shared staging (windows of one frame here: the next
    fetched while one is checked), are copied into the arena, and the staging
    is given back whatever the read stopped at."""
    import lmkv_mooncake.backend

    monkeypatch.setattr(lmkv_mooncake.backend, "THIN_PIPELINE_BYTES", 1)
    tier = make_tier(real_client)
    assert put(tier, [0, 1, 2, 4, 5]) == 5
    other = torch.arange(64, dtype=torch.float32).reshape(4, 16)  # another shape and dtype
    assert tier.batched_submit_put([key(9)], [tensor_obj(other)]).result(timeout=60) == 1
    assert torch.equal(read(tier, 0), chunk(0))  # by its size: learns the layout
    arena = tier.context.allocate.__self__
    used, staged = arena.used_bytes, tier.staging.used_bytes
    for _ in range(10):
        objs = tier.batched_get_non_blocking("l", [key(i) for i in range(6)]).result(60)
        try:
            assert len(objs) == 3
            assert all(o.allocator is arena for o in objs)  # copies, not the staging
            for i, obj in enumerate(objs):
                assert torch.equal(obj.tensor, chunk(i))
        finally:
            for obj in objs:
                obj.ref_down()
        assert arena.used_bytes == used and tier.staging.used_bytes == staged
    objs = tier.batched_get_non_blocking("l", [key(0), key(9), key(1)]).result(60)
    try:
        assert [tuple(o.shape) for o in objs] == [tuple(chunk(0).shape), (4, 16),
                                                  tuple(chunk(1).shape)]
        assert torch.equal(objs[1].tensor, other) and torch.equal(objs[2].tensor, chunk(1))
    finally:
        for obj in objs:
            obj.ref_down()
    assert tier.stats()["errors"] == 0 and tier.stats()["corrupt_frames"] == 0
