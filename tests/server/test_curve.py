"""CURVE on a real ``lmkv server`` process: only holders of an authorized key get data;
everyone else gets misses and the server keeps serving. And the refusal to listen
beyond loopback without CURVE."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from lmkv.rpc.auth import CurveKeys, load_keypair, load_public_key, write_keypair
from lmkv.rpc.client import ServerClient
from tests.server.procs import (
    REPO,
    ServerProcess,
    child_env,
    chunk_ends,
    chunk_for,
    free_port,
    prompt_keys,
    same_bytes,
    wait_for,
    write_config,
)

pytestmark = [
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
    pytest.mark.slow,  # real lmkv server processes
]


@dataclass
class Keys:
    server_secret: Path
    server: bytes  # the server's public key
    authorized_dir: Path
    client: CurveKeys  # authorized
    rogue: tuple[bytes, bytes]  # a valid key pair that is not on the list


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("curve")
    server_public, server_secret = write_keypair(root / "server", "server")
    authorized = root / "clients"
    _client_public, _client_secret = write_keypair(authorized, "engine")
    authorized.chmod(0o755)
    (authorized / "engine.key_secret").rename(root / "engine.key_secret")  # only .key stays
    _, rogue_secret = write_keypair(root / "rogue", "rogue")
    public, secret = load_keypair(root / "engine.key_secret")
    server = load_public_key(server_public)
    return Keys(server_secret, server, authorized,
                CurveKeys(public, secret, server_key=server), load_keypair(rogue_secret))


def launch(tmp: Path, *args: str, name: str = "server") -> tuple[subprocess.Popen, int, Path]:
    cfg = write_config(tmp / f"{name}.yaml")
    port = free_port()
    log = tmp / f"{name}-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmkv.server", "--config", str(cfg),
                                 "--port", str(port), *args], stdout=out,
                                stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    return proc, port, log


def started(proc: subprocess.Popen, port: int, log: Path, curve: CurveKeys | None
            ) -> ServerProcess:
    server = ServerProcess(proc, port, log)
    with ServerClient(server.address, timeout_ms=500, curve=curve) as client:
        info = wait_for(lambda: proc.poll() is not None or client.ping(), timeout_s=30)
    if proc.poll() is not None or not info:
        server.stop(signal.SIGKILL)
        raise AssertionError(f"server did not start:\n{server.log()}")
    return server


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory: pytest.TempPathFactory, keys: Keys
                 ) -> Iterator[ServerProcess]:
    """Listening on every interface: CURVE makes that allowed without --insecure."""
    proc, port, log = launch(tmp_path_factory.mktemp("curve-server"), "--host", "0.0.0.0",
                             "--curve-secret-key", str(keys.server_secret),
                             "--curve-authorized-keys", str(keys.authorized_dir))
    server = started(proc, port, log, keys.client)
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_an_authorized_client_stores_and_retrieves(curve_server, keys, data_path) -> None:
    prompt = 1 if data_path == "auto" else 2
    keys_ = prompt_keys(prompt)
    chunks = [chunk_for(k) for k in keys_]
    with curve_server.client(curve=keys.client, data_path=data_path) as client:
        assert client.store(keys_, chunks) == len(keys_)
        assert client.lookup(keys_, chunk_ends(keys_)) == chunk_ends(keys_)[-1]
        got = client.retrieve(keys_)
        assert client.shared_memory == (data_path == "auto")
    assert len(got) == len(chunks) and all(map(same_bytes, got, chunks))
    assert "CURVE, 1 authorized client keys" in curve_server.log()


def test_a_reconnected_client_keeps_its_keys_for_every_connection(curve_server, keys) -> None:
    """After close_connection the client reconnects: its requests and its heartbeat
    (which renews handles during long copies) must both still speak CURVE."""
    keys_ = prompt_keys(3)
    chunks = [chunk_for(k) for k in keys_]
    with curve_server.client(curve=keys.client) as client:
        client.close_connection()
        assert client.store(keys_, chunks) == len(keys_)
        assert all(map(same_bytes, client.retrieve(keys_), chunks))
        assert client._heartbeat._curve is keys.client


def outsiders(keys: Keys) -> dict[str, CurveKeys | None]:
    rogue_public, rogue_secret = keys.rogue
    return {
        "no keys": None,
        "wrong server key": CurveKeys(keys.client.public, keys.client.secret,
                                      server_key=rogue_public),
        "unauthorized key": CurveKeys(rogue_public, rogue_secret, server_key=keys.server),
    }


WHY = {"no keys": "wants CURVE",  # either line a client without CURVE is told
       "wrong server key": "is server.curve.server_key this server's public key?",
       "unauthorized key": "the server refused this client's CURVE key"}


@pytest.mark.parametrize("who", ["no keys", "wrong server key", "unauthorized key"])
def test_outsiders_get_misses_and_the_server_keeps_serving(curve_server, keys, who) -> None:
    base = 10 + 2 * ["no keys", "wrong server key", "unauthorized key"].index(who)
    stored = prompt_keys(base)
    chunks = [chunk_for(k) for k in stored]
    with curve_server.client(curve=keys.client) as owner:
        assert owner.store(stored, chunks) == len(stored)
    planted = prompt_keys(base + 1)
    with ServerClient(curve_server.address, timeout_ms=300, data_path="inline",
                      curve=outsiders(keys)[who]) as outsider:
        assert outsider.ping() is None
        assert WHY[who] in outsider.connection_problem()  # not "no lmkv server"
        assert outsider.lookup(stored, chunk_ends(stored)) == 0
        assert outsider.retrieve(stored) == []
        assert outsider.store(planted, [chunk_for(k) for k in planted]) == 0
        assert outsider.counters.dropped_chunks == len(planted)
        assert outsider.stats() is None
    with curve_server.client(curve=keys.client) as owner:
        assert owner.lookup(planted, chunk_ends(planted)) == 0  # nothing was planted
        got = owner.retrieve(stored)
        assert len(got) == len(chunks) and all(map(same_bytes, got, chunks))
    if who == "unauthorized key":
        assert wait_for(lambda: "unauthorized CURVE key" in curve_server.log()), \
            curve_server.log()


def test_a_client_without_curve_is_told_the_server_wants_curve(curve_server) -> None:
    result = subprocess.run([sys.executable, "-m", "lmkv", "stats", "--server",
                             curve_server.address], capture_output=True, text=True,
                            env=child_env(), cwd=REPO, timeout=60)
    assert result.returncode == 2
    said = f"lmkv: error: cannot connect to the lmkv server at {curve_server.address}: "
    # ZMQ reports the mechanism mismatch when the client read the server's error
    # before the server hung up; else the handshake just ended (timing decides).
    assert result.stderr.strip() in (
        said + "the server wants CURVE: give this client the CURVE keys of server.curve "
        "(docs/security.md)",
        said + "the server ended the handshake: it wants CURVE (give this client the CURVE "
        "keys of server.curve, docs/security.md), or it is not an lmkv server"), result.stderr
    # The server says so too (rate-limited). Which line it writes depends on how far
    # the handshake got before the client hung up: ZMQ reports the mechanism
    # mismatch only when it read the client's greeting, else a failure with no
    # detail (on a loaded machine, the command may be gone by then).
    assert wait_for(lambda: "a client without CURVE tried to connect" in curve_server.log()
                    or "CURVE handshake on" in curve_server.log()), curve_server.log()


def test_a_secret_key_others_can_read_stops_the_server_with_one_line(tmp_path, keys) -> None:
    leaky = tmp_path / "leaky.key_secret"
    leaky.write_bytes(keys.server_secret.read_bytes())
    leaky.chmod(0o644)
    proc, _, log = launch(tmp_path, "--curve-secret-key", str(leaky),
                          "--curve-authorized-keys", str(keys.authorized_dir))
    assert proc.wait(60) == 2
    lines = log.read_text().strip().splitlines()
    assert len(lines) == 1 and "mode 0644" in lines[0], lines


def test_a_non_loopback_host_without_curve_is_refused_with_one_line(tmp_path) -> None:
    proc, _, log = launch(tmp_path, "--host", "0.0.0.0")
    assert proc.wait(60) == 2
    lines = log.read_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert "--host 0.0.0.0 is not loopback" in lines[0] and "--insecure" in lines[0]


def test_insecure_starts_beyond_loopback_and_warns_at_each_start(tmp_path) -> None:
    for start in range(2):
        proc, port, log = launch(tmp_path, "--host", "0.0.0.0", "--insecure",
                                 name=f"insecure-{start}")
        server = started(proc, port, log, None)
        try:
            with server.client() as client:
                assert client.ping() is not None
            assert "INSECURE: serving 0.0.0.0 without CURVE" in server.log()
        finally:
            assert server.stop(signal.SIGTERM) == 0, server.log()


def test_the_config_can_name_the_keys(tmp_path, keys) -> None:
    """``server.curve`` in the config the server reads, instead of the flags."""
    config = tmp_path / "curve.yaml"
    config.write_text(
        "tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n"
        f"server:\n  curve:\n    secret_key: {keys.server_secret}\n"
        f"    authorized_keys: {keys.authorized_dir}\n")
    port = free_port()
    log = tmp_path / "cfg.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmkv.server", "--config", str(config),
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(), cwd=REPO)
    server = started(proc, port, log, keys.client)
    try:
        with ServerClient(server.address, timeout_ms=300) as plain:
            assert plain.ping() is None  # CURVE is on although the host is loopback
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()


def test_a_request_in_flight_is_answered_once_the_handshake_is_done(curve_server,
                                                                    keys) -> None:
    """The first request on a fresh connection waits for the handshake, not fails."""
    for _ in range(3):
        with curve_server.client(curve=keys.client) as client:
            t0 = time.monotonic()
            assert client.ping() is not None, time.monotonic() - t0
