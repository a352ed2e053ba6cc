"""A real mooncake_master on loopback ports, started and stopped by the tests.

Its RPC server, its HTTP metadata server and its metrics server all bind to
127.0.0.1 (the metadata server would otherwise listen on every interface).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from lmkv import BackendContext
from lmkv.memory import MemoryAllocator


def _find_master() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


MOONCAKE_MASTER = _find_master()


def _find_real_client() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_client"
    return str(beside) if beside.exists() else shutil.which("mooncake_client")


MOONCAKE_CLIENT = _find_real_client()


def have_client() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


SKIP_REASON = ("mooncake_master or the Mooncake client is not installed "
               "(pip install 'lmkv-mooncake[cpu]'; scripts/setup.sh does)")
AVAILABLE = MOONCAKE_MASTER is not None and have_client()
#: CI sets CI_REQUIRE_MOONCAKE=1: a broken install fails instead of skipping
#: (not LMKV_*: that prefix is reserved for lmkv config keys).
REQUIRED = os.environ.get("CI_REQUIRE_MOONCAKE") == "1"


def require_mooncake() -> None:
    """Skip the calling test when Mooncake is missing, or fail it under
    CI_REQUIRE_MOONCAKE=1."""
    import pytest

    if AVAILABLE:
        return
    if REQUIRED:
        pytest.fail(f"CI_REQUIRE_MOONCAKE=1 but {SKIP_REASON}")
    pytest.skip(SKIP_REASON)


def listening_addresses() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from
    /proc/net/tcp{,6} matched by inode against /proc/self/fd (Linux only)."""
    import ipaddress

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def off_loopback(addresses: list[tuple[str, int]]) -> list[tuple[str, int]]:
    import ipaddress

    return [(a, p) for a, p in addresses if not ipaddress.ip_address(a).is_loopback
            and not (ipaddress.ip_address(a).version == 6
                     and ipaddress.ip_address(a).ipv4_mapped is not None
                     and ipaddress.ip_address(a).ipv4_mapped.is_loopback)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class _Service:
    """A process the tests start, wait for, kill and stop."""

    proc: subprocess.Popen | None

    def _wait_for(self, ports: tuple[int, ...], what: str, log: Path) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 30
        while not all(_listening(port) for port in ports):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited: see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up in 30 s")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class MooncakeMaster(_Service):
    directory: Path
    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.rpc_port = self.rpc_port or free_port()
        self.http_port = self.http_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def options(self, **extra: object) -> dict:
        """Tier options for a client of this master (a small segment and buffer)."""
        return {"master_address": self.address, "metadata_server": self.metadata_url,
                "local_hostname": "127.0.0.1", "global_segment_size": "64MiB",
                "local_buffer_size": "32MiB", "retry_after_s": 0.2, **extra}

    def start(self) -> MooncakeMaster:
        assert MOONCAKE_MASTER is not None
        log = open(self.directory / "master.log", "ab")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen(
            [MOONCAKE_MASTER, "--rpc_address", "127.0.0.1", "--rpc_port", str(self.rpc_port),
             "--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
             "--http_metadata_server_port", str(self.http_port),
             "--metrics_host", "127.0.0.1", "--metrics_port", str(self.metrics_port),
             "--client_ttl", "3"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
            start_new_session=True)
        log.close()
        self._wait_for((self.rpc_port, self.http_port), "mooncake_master",
                       self.directory / "master.log")
        return self

    def summary(self) -> str:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics/summary", timeout=5) as reply:
            return reply.read().decode()

    def mounted_bytes(self) -> int:
        """Memory the pool's mounted segments hold ("Mem Storage: used / TOTAL")."""
        match = re.search(r"Mem Storage: [^/]+/ ([0-9.]+) (B|KB|MB|GB|TB)", self.summary())
        assert match, "the master's summary has no Mem Storage figure"
        scale = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
        return int(float(match.group(1)) * scale[match.group(2)])


@dataclass
class MooncakeRealClient(_Service):
    """A ``mooncake_client`` (Mooncake's standalone real client) of ``master``:
    it holds the segment; tiers with ``client_address`` hand it shared memory."""

    master: MooncakeMaster
    directory: Path
    port: int = 0
    segment: str = "256MB"
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def options(self, **extra: object) -> dict:
        """Tier options for a thin client of this real client."""
        return {"client_address": self.address, "local_buffer_size": "32MiB",
                "retry_after_s": 0.2, **extra}

    def start(self) -> MooncakeRealClient:
        assert MOONCAKE_CLIENT is not None
        log = open(self.directory / "client.log", "ab")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen(
            [MOONCAKE_CLIENT, "--host", "127.0.0.1", "--port", str(self.port),
             "--master_server_address", self.master.address,
             "--metadata_server", self.master.metadata_url,
             "--global_segment_size", self.segment, "--protocol", "tcp"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory, start_new_session=True)
        log.close()
        self._wait_for((self.port,), "mooncake_client", self.directory / "client.log")
        return self


_ARENAS: list[MemoryAllocator] = []


def new_tier(master: MooncakeMaster | MooncakeRealClient, **options: object) -> object:
    """A tier of ``master`` under its own key prefix (unless given), with its own arena."""
    from lmkv_backends.serde.naive import NaiveSerializer
    from lmkv_mooncake import MooncakeBackend, MooncakeOptions

    arena = MemoryAllocator(16 << 20, pin_memory=False)
    # Kept for the session: the process's shared Mooncake client keeps the arena
    # registered, and a later arena at an overlapping address would be refused
    # (-600), sending its chunks through staging instead of the direct path.
    _ARENAS.append(arena)
    options.setdefault("key_prefix", f"t-{uuid.uuid4().hex[:8]}:")
    return MooncakeBackend(MooncakeOptions(**master.options(**options)),
                           BackendContext(serializer=NaiveSerializer(), allocate=arena.allocate))


class OwnStoreEdits:
    """``corrupt_entry`` and ``copy_entry`` of the conformance kit, done with the
    tier's own Mooncake client behind its back."""

    def corrupt_entry(self, backend: object, key: object) -> bool:
        """Flip a payload bit (get, remove, put)."""
        store, name = own_store(backend), backend.store_key(key)
        frame = bytearray(store.get(name))
        frame[-10] ^= 1
        assert store.remove(name, True) == 0
        assert store.put(name, bytes(frame)) == 0
        return True

    def copy_entry(self, backend: object, source: object, target: object) -> bool:
        """Store source's whole frame under target's name."""
        store = own_store(backend)
        frame = store.get(backend.store_key(source))
        store.remove(backend.store_key(target), True)
        assert store.put(backend.store_key(target), frame) == 0
        return True


def own_store(backend: object) -> object:
    with backend.link.using() as store:  # the tier's own client, behind its back
        return store
