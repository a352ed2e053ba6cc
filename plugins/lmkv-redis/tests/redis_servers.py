"""Real redis-server processes for the tests: one server, a 3-master cluster, TLS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (and port + 10000, a cluster node's bus port, when asked)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536 and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1, started and stopped by the tests."""

    directory: Path
    port: int = 0
    args: list[str] = field(default_factory=list)
    tls: bool = False
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls else [
            "--port", str(self.port)]
        with open(self.directory / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory), *self.args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port} did not start: {self.log_tail()}")

    def log_tail(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def client(self, db: int = 0, **kwargs: object) -> redis.Redis:
        """A plain redis-py client, for looking behind the tier's back."""
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, protocol=2, **kwargs)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class RedisCluster:
    """Three masters, no replicas, on loopback ports."""

    directory: Path
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for i in range(3):
            node = RedisServer(self.directory / f"node{i}", free_port(with_bus=True), args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000"])
            self.nodes.append(node.start())
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas",
                        "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self._wait_ok()
        return self

    def _wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [n.client().execute_command("CLUSTER", "INFO") for n in self.nodes]
            if all(b"cluster_state:ok" in s for s in states):
                return
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
