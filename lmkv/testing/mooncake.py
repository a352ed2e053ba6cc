"""Mooncake on loopback for tests, end-to-end runs and benchmarks.

* ``MooncakeMaster``: a ``mooncake_master`` whose RPC, HTTP metadata and
  metrics listeners bind 127.0.0.1 (the metadata server would otherwise
  listen on every interface); ``options()`` are a ``mooncake`` tier's options
  for a client of it.
* ``MooncakeRealClient``: a ``mooncake_client`` (Mooncake's standalone real
  client) of a master, holding the segment; tiers with ``client_address`` are
  thin clients of it.
* ``MooncakePool``: a master and a holder process that lends the pool one
  segment, so the engines are pure clients and what one stored outlives it
  (``real_client``: the holder is a ``mooncake_client``).
* ``require_mooncake()``: skip a test without Mooncake, or fail it under
  ``CI_REQUIRE_MOONCAKE=1``.

Traffic goes to 127.0.0.1 only, but every client's transfer engine listens on
every interface: Mooncake 0.3.13 gives no way to bind it (docs/security.md).
Needs the Mooncake client (``lmkv-mooncake[cpu]``); nothing here imports the
plugin.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lmkv.testing.processes import Service, free_port


def master_binary(name: str = "mooncake_master") -> str | None:
    """``mooncake_master`` (or ``name``) beside this Python, else on the PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


MOONCAKE_MASTER = master_binary()
MOONCAKE_CLIENT = master_binary("mooncake_client")


def have_client() -> bool:
    """Whether the Mooncake client library is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("mooncake.store") is not None
    except ImportError:  # no mooncake package at all
        return False


SKIP_REASON = ("mooncake_master or the Mooncake client is not installed "
               "(pip install 'lmkv-mooncake[cpu]'; scripts/setup.sh does)")
#: CI sets CI_REQUIRE_MOONCAKE=1: a broken install fails instead of skipping
#: (not LMKV_*: that prefix is reserved for lmkv config keys).
REQUIRE_ENV = "CI_REQUIRE_MOONCAKE"


def mooncake_available() -> bool:
    return MOONCAKE_MASTER is not None and have_client()


def require_mooncake() -> None:
    """Skip the calling test when Mooncake is missing, or fail it under
    ``CI_REQUIRE_MOONCAKE=1``."""
    import pytest

    if mooncake_available():
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {SKIP_REASON}")
    pytest.skip(SKIP_REASON)


@dataclass
class MooncakeMaster(Service):
    """A ``mooncake_master`` on 127.0.0.1. ``client_ttl_s``: how soon it unmounts
    the segment of a client that stopped its heartbeats (None: Mooncake's)."""

    directory: Path
    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    client_ttl_s: int | None = 3

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

    @property
    def log(self) -> Path:
        return self.directory / "master.log"

    def options(self, **extra: Any) -> dict[str, Any]:
        """Tier options for a client of this master (a small segment and buffer)."""
        return {"master_address": self.address, "metadata_server": self.metadata_url,
                "local_hostname": "127.0.0.1", "global_segment_size": "64MiB",
                "local_buffer_size": "32MiB", "retry_after_s": 0.2, **extra}

    def start(self) -> MooncakeMaster:
        """Start it (again: on the same ports, empty) and wait until it listens."""
        assert MOONCAKE_MASTER is not None, SKIP_REASON
        ttl = [] if self.client_ttl_s is None else ["--client_ttl", str(self.client_ttl_s)]
        self.launch([MOONCAKE_MASTER, "--rpc_address", "127.0.0.1",
                     "--rpc_port", str(self.rpc_port), "--enable_http_metadata_server=true",
                     "--http_metadata_server_host", "127.0.0.1",
                     "--http_metadata_server_port", str(self.http_port),
                     "--metrics_host", "127.0.0.1", "--metrics_port", str(self.metrics_port),
                     *ttl], self.log, cwd=self.directory)
        self.wait_for((self.rpc_port, self.http_port), "mooncake_master", self.log)
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
class MooncakeRealClient(Service):
    """A ``mooncake_client`` of ``master`` on 127.0.0.1: it holds the segment;
    tiers with ``client_address`` hand it shared memory."""

    master: MooncakeMaster
    directory: Path
    port: int = 0
    segment: str = "256MB"

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "client.log"

    def options(self, **extra: Any) -> dict[str, Any]:
        """Tier options for a thin client of this real client."""
        return {"client_address": self.address, "local_buffer_size": "32MiB",
                "retry_after_s": 0.2, **extra}

    def start(self) -> MooncakeRealClient:
        assert MOONCAKE_CLIENT is not None, "mooncake_client is not installed"
        self.launch([MOONCAKE_CLIENT, "--host", "127.0.0.1", "--port", str(self.port),
                     "--master_server_address", self.master.address,
                     "--metadata_server", self.master.metadata_url,
                     "--global_segment_size", self.segment, "--protocol", "tcp"],
                    self.log, cwd=self.directory)
        self.wait_for((self.port,), "mooncake_client", self.log)
        return self


class MooncakePool:
    """A master and a holder lending ``segment_bytes``; ``options`` are the
    ``mooncake`` tier options of a pure client of it."""

    def __init__(self, tmp: str, segment_bytes: int = 256 << 20,
                 key_prefix: str = "lmkv:", real_client: bool = False) -> None:
        if MOONCAKE_MASTER is None:
            raise RuntimeError("mooncake_master not found: pip install 'lmkv-mooncake[cpu]'")
        self.master = MooncakeMaster(Path(tmp) / "mooncake-master", client_ttl_s=None)
        self.services: list[Service] = [self.master]
        self.holder: subprocess.Popen | None = None
        try:
            self.master.start()
            if real_client:
                self._start_real_client(Path(tmp), segment_bytes, key_prefix)
            else:
                self._start_holder(Path(tmp), segment_bytes, key_prefix)
        except BaseException:
            self.close()
            raise

    def _start_holder(self, tmp: Path, segment_bytes: int, key_prefix: str) -> None:
        self.options: dict[str, Any] = {
            **self.master.options(global_segment_size=0, local_buffer_size="64MiB",
                                  key_prefix=key_prefix)}
        self.options.pop("retry_after_s")
        holder = ("import sys; from mooncake.store import MooncakeDistributedStore as S; "
                  f"s = S(); code = s.setup('127.0.0.1', '{self.master.metadata_url}', "
                  f"{segment_bytes}, 16 << 20, 'tcp', '', '{self.master.address}'); "
                  "print('ready' if code == 0 else code, flush=True); sys.stdin.read(); s.close()")
        log: IO[bytes]
        with open(tmp / "mooncake-holder.log", "ab") as log:
            self.holder = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the Mooncake holder could not set up")

    def _start_real_client(self, tmp: Path, segment_bytes: int, key_prefix: str) -> None:
        if MOONCAKE_CLIENT is None:
            raise RuntimeError("mooncake_client not found: pip install 'lmkv-mooncake[cpu]'")
        client = MooncakeRealClient(self.master, tmp / "mooncake-client",
                                    segment=f"{segment_bytes >> 20}MB")
        self.services.append(client)
        client.start()
        self.options = {"client_address": client.address, "local_buffer_size": "64MiB",
                        "key_prefix": key_prefix}

    @staticmethod
    def available() -> bool:
        """The Mooncake client, the plugin, ``mooncake_master`` and ``mooncake_client``
        are installed."""
        return None not in (MOONCAKE_MASTER, MOONCAKE_CLIENT) and have_client() \
            and importlib.util.find_spec("lmkv_mooncake") is not None

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            if self.holder.stdin is not None:
                self.holder.stdin.close()  # it closes its store and exits
            try:
                self.holder.wait(30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        for service in reversed(self.services):
            service.stop()

