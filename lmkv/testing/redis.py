"""Real redis-server processes on loopback for tests: one server (plain or TLS),
a three-master cluster, and the certificate a TLS server uses.

They need ``redis-server`` and ``redis-cli`` on the PATH (Debian:
``apt-get install redis-server``); ``require_redis`` skips a test without
them. Each server binds 127.0.0.1 only, keeps nothing on disk, and is
stopped (SIGTERM, then SIGKILL) by ``stop``, paused or not.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmkv.testing.processes import Service, free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def require_redis() -> None:
    """Skip the calling test when redis-server or redis-cli is not installed."""
    import pytest

    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli are not installed")


@dataclass
class RedisServer(Service):
    """One redis-server on 127.0.0.1, started and stopped by the tests."""

    directory: Path
    port: int = 0
    args: list[str] = field(default_factory=list)
    tls: bool = False

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> RedisServer:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls else [
            "--port", str(self.port)]
        self.launch([REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.directory), *self.args], self.log)
        self.wait_for((self.port,), f"redis-server on {self.port}", self.log)
        return self

    def client(self, db: int = 0, **kwargs: Any) -> Any:
        """A plain redis-py client, for looking behind the tier's back."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=db, protocol=2, **kwargs)


@dataclass
class RedisCluster:
    """Three masters, no replicas, on loopback ports."""

    directory: Path
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        import time

        assert REDIS_CLI is not None, "redis-cli is not installed"
        for i in range(3):
            node = RedisServer(self.directory / f"node{i}", free_port(with_bus=True), args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000"])
            self.nodes.append(node.start())
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas",
                        "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [n.client().execute_command("CLUSTER", "INFO") for n in self.nodes]
            if all(b"cluster_state:ok" in s for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def make_tls_files(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made with openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key
