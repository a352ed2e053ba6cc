"""The server's default address: an ipc socket only this user can reach.

A real server process listens on its default (no --host/--port/--socket); a
client of the same user stores and retrieves through it; a second local user
(``nobody``) cannot connect, and a client never connects to a socket in a
directory another user controls.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lmkv.rpc.client import ServerClient
from tests.server.procs import (
    REPO,
    child_env,
    chunk_for,
    prompt_keys,
    same_bytes,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow  # real lmkv server processes

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def runtime_base():
    """A directory every user may traverse (so only the runtime dir's own mode keeps
    others out), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="lmkv-private-"))
    base.chmod(0o755)
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture
def default_server(runtime_base, tmp_path):
    env = {**child_env(), "XDG_RUNTIME_DIR": str(runtime_base)}
    cfg = write_config(tmp_path / "server.yaml")
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmkv.server", "--config", str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    address = f"ipc://{runtime_base}/lmkv/server.sock"
    client = ServerClient(address, timeout_ms=500)
    try:
        assert wait_for(lambda: proc.poll() is not None or client.ping(), timeout_s=30), \
            log_path.read_text()
    finally:
        client.close()
    yield address, log_path
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def test_the_default_socket_is_private_and_serves_this_user(default_server,
                                                            runtime_base) -> None:
    address, log_path = default_server
    runtime = runtime_base / "lmkv"
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE((runtime / "server.sock").stat().st_mode) == 0o600
    keys = prompt_keys(7)
    chunks = [chunk_for(k) for k in keys]
    with ServerClient(address, timeout_ms=5000) as client:
        assert client.store(keys, chunks) == len(keys)
        assert all(map(same_bytes, client.retrieve(keys), chunks))
    assert "this user only" in log_path.read_text()


# A bare AF_UNIX connect, by the system's Python (the test venv's may live where
# another user cannot run it): a socket nobody else can reach is refused here.
PROBE = """
import socket, sys
sock = socket.socket(socket.AF_UNIX)
try:
    sock.connect(sys.argv[1])
    print("CONNECTED")
except OSError as exc:
    print("REFUSED", exc.errno)
"""
SYSTEM_PYTHON = "/usr/bin/python3"


def as_nobody(path: Path) -> str:
    done = subprocess.run([SYSTEM_PYTHON, "-c", PROBE, str(path)], capture_output=True,
                          text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"},
                          preexec_fn=lambda: (os.setgid(NOBODY), os.setuid(NOBODY)))
    return done.stdout.strip() or done.stderr.strip()


@needs_root
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no system Python to run as nobody")
def test_another_local_user_cannot_reach_the_default_socket(default_server,
                                                            runtime_base) -> None:
    socket_path = runtime_base / "lmkv" / "server.sock"
    assert as_nobody(socket_path).startswith("REFUSED")
    # Control: opened up, the same probe gets in (the check above can fail).
    (runtime_base / "lmkv").chmod(0o755)
    socket_path.chmod(0o666)
    assert as_nobody(socket_path) == "CONNECTED"


@needs_root
def test_a_client_never_connects_into_a_directory_another_user_controls(runtime_base) -> None:
    foreign = runtime_base / "foreign"
    foreign.mkdir(mode=0o777)
    foreign.chmod(0o777)  # anyone could have bound a socket here
    client = ServerClient(f"ipc://{foreign}/server.sock", timeout_ms=300)
    try:
        started = time.monotonic()
        assert client.ping() is None and client.lookup(prompt_keys(1), [16, 32, 48, 64]) == 0
        assert time.monotonic() - started < 30
    finally:
        client.close()
    os.chown(foreign, NOBODY, NOBODY)
    foreign.chmod(0o755)
    client = ServerClient(f"ipc://{foreign}/server.sock", timeout_ms=300)
    try:
        assert client.ping() is None
    finally:
        client.close()


def test_the_server_refuses_a_socket_directory_others_can_write(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = write_config(tmp_path / "server.yaml")
    done = subprocess.run([sys.executable, "-m", "lmkv.server", "--config", str(cfg),
                           "--socket", str(shared / "server.sock")], capture_output=True,
                          text=True, timeout=60, env=child_env(), cwd=REPO)
    assert done.returncode != 0
    err = done.stderr.strip()
    assert err.count("\n") == 0 and "writable by group or others" in err, err
    assert not (shared / "server.sock").exists()
