"""The tier as a thin client of a ``mooncake_client`` (``client_address``):
Mooncake's standalone real client holds the segment and the master connection,
the tier moves frames through memory it maps from it. Against a real master and
a real ``mooncake_client`` on loopback.

Runs in a pytest process of its own (``test_mooncake_real_client.py`` starts
it): Mooncake 0.3.13 aborts when thin and embedded clients share a process,
which the tier refuses, and the rest of this suite makes embedded ones.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_helpers import OwnStoreEdits, new_tier
from test_mooncake_faults import chunk, key, misses_then_recovery, put, read, reads_prefix

from lmkv.contracts import ConfigError, StorageBackend, tensor_obj
from lmkv.testing import StorageBackendConformance
from lmkv.testing.engine_worker import shared_between_processes
from lmkv.testing.mooncake import (
    MOONCAKE_CLIENT,
    MooncakeMaster,
    MooncakeRealClient,
    require_mooncake,
)
from lmkv_mooncake import MooncakeBackend


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


class TestMooncakeRealClient(OwnStoreEdits, StorageBackendConformance):
    backend_class = MooncakeBackend
    client: MooncakeRealClient

    def backend_options(self) -> dict[str, Any]:
        return self.client.options(key_prefix=f"t-{uuid.uuid4().hex[:8]}:")

    @pytest.fixture(autouse=True)
    def _client(self, real_client: MooncakeRealClient) -> None:
        self.client = real_client

    def make_backend(self) -> StorageBackend:
        return new_tier(self.client)



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
    # Killed, the real client takes its segment and every entry in it.
    tier = make_tier(own_real_client)
    misses_then_recovery(tier, own_real_client.kill, own_real_client.start)
    assert tier.stats()["direct_gets"] == 0  # it cannot write into lmkv's arena


def test_two_engine_processes_share_kv_through_the_hosts_real_client(
        own_real_client: MooncakeRealClient, tmp_path: Path) -> None:
    # This process holds no store at all: the KV lives in the real client's
    # segment, so it outlives the engine that stored it.
    shared_between_processes({"type": "mooncake", "options": own_real_client.options(
        key_prefix="real-procs:")}, tmp_path)


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
        reads_prefix(tier, 6, 3, allocator=arena)  # copies, not the staging
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


@pytest.mark.parametrize("call", ["get_size", "batch_get_into",
                                  "batch_get_into_multi_buffers"])
def test_a_thin_get_of_an_entry_still_being_written_is_a_miss(
        real_client: MooncakeRealClient, make_tier: object,
        monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """REPLICA_IS_NOT_READY (another engine's put not ended yet), whichever
    call answers it (by its size before the layout is known, window by window
    after): a miss, not an error; the staging goes back."""
    from test_mooncake_failed_gets import failing

    tier = make_tier(real_client)
    assert put(tier, [0, 1]) == 2
    if call == "batch_get_into_multi_buffers":
        assert torch.equal(read(tier, 0), chunk(0))  # learns the layout
    staged = tier.staging.used_bytes
    errors = tier.stats()["errors"]
    store = failing(tier, monkeypatch, **{call: (lambda size: -703) if call == "get_size"
                                          else (lambda codes: [-703] * len(codes))})
    assert read(tier, 1) is None
    assert store.calls[-1] == call
    assert tier.stats()["errors"] == errors
    assert tier.staging.used_bytes == staged
    assert not tier.faults.breaker.is_open
