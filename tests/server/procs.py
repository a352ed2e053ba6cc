"""Real server processes on loopback for the server tests, and the chunk data they move.

Chunk contents are a pure function of the chunk's key, so any process can
check that what it retrieves is byte-identical to what some process stored.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmkv.keys.chunking import CacheKey, KeyMeta, prefix_hashes
from lmkv.memory.shm import huge_segment_name
from lmkv.rpc.client import ServerClient

REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
META = KeyMeta("server-test")
CHUNK_TOKENS = 16
SHAPE = (2, 2, 256, 2, 16)  # 64 KiB of bfloat16
CHUNK_BYTES = 2 * 2 * 256 * 2 * 16 * 2


def prompt_keys(prompt: int, chunks: int = 4) -> list[CacheKey]:
    tokens = [prompt * 100_000 + i for i in range(chunks * CHUNK_TOKENS)]
    return [CacheKey(META, h) for h in prefix_hashes(tokens, CHUNK_TOKENS)]


def chunk_ends(keys: list[CacheKey]) -> list[int]:
    return [CHUNK_TOKENS * (i + 1) for i in range(len(keys))]


def chunk_for(key: CacheKey, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key.chunk_hash[:8], "little"))
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmkv_segments() -> set[str]:
    """The names of the lmkv segments alive now: in /dev/shm, and the huge-page ones
    (``/proc/<pid>/fd/<n>``, live while their creator holds them) on a host that
    has huge pages reserved."""
    names = {p.name for p in SHM_DIR.glob("lmkv-*")} if SHM_DIR.is_dir() else set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            target = os.readlink(fd)
            if target.startswith("/memfd:lmkv-"):  # named as clients are handed it
                memfd = target.removeprefix("/memfd:").removesuffix(" (deleted)")
                names.add(huge_segment_name(str(fd), memfd, os.stat(fd)))
        except OSError:  # gone meanwhile, or another user's
            continue
    return names


def wait_for(predicate, timeout_s: float = 15.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def child_env(extra_path: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    paths = [str(REPO), *([str(extra_path)] if extra_path else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    return env


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    shm_name: str = ""
    socket: Path | None = None  # listening on this ipc socket instead of the port

    @property
    def address(self) -> str:
        return f"ipc://{self.socket}" if self.socket else f"tcp://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> ServerClient:
        kwargs.setdefault("timeout_ms", 5000)
        return ServerClient(self.address, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def final_tier_stats(self) -> list[dict]:
        marker = "final tier stats: "
        lines = [ln for ln in self.log().splitlines() if marker in ln]
        assert lines, self.log()
        return json.loads(lines[-1].split(marker, 1)[1])


def write_config(path: Path, text: str | None = None) -> Path:
    path.write_text(text or "tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n")
    return path


def start_server(tmp: Path, config: str | None = None, *args: str, port: int | None = None,
                 extra_path: Path | None = None, name: str = "server",
                 socket_dir: Path | None = None) -> ServerProcess:
    """Start ``python -m lmkv.server`` and wait until it answers a ping; on a free
    loopback port, or with ``socket_dir``, on an ipc socket there."""
    cfg = write_config(tmp / f"{name}.yaml", config)
    port = port or free_port()
    log_path = tmp / f"{name}-{port}-{time.monotonic_ns()}.log"
    sock = socket_dir / f"{name}.sock" if socket_dir is not None else None
    where = ["--socket", str(sock)] if sock is not None else ["--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmkv.server", "--config", str(cfg), *where, *args],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(extra_path), cwd=REPO)
    server = ServerProcess(proc, port, log_path, socket=sock)
    client = ServerClient(server.address, timeout_ms=500)
    try:
        info = wait_for(lambda: proc.poll() is not None or client.ping(), timeout_s=30)
    finally:
        client.close()
    if proc.poll() is not None or not info:
        server.stop(signal.SIGKILL)
        raise AssertionError(f"server did not start:\n{server.log()}")
    server.shm_name = info.shm_name
    return server
