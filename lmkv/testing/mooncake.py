"""A Mooncake pool on loopback for end-to-end runs and benchmarks: a
``mooncake_master`` (its RPC, metadata and metrics listeners on 127.0.0.1) and
a holder process that lends the pool one segment, so the engines are pure
clients and what one stored outlives it. With ``real_client``, the holder is a
``mooncake_client`` (Mooncake's standalone real client) and the engines are
thin clients of it (the tier's ``client_address``), moving bytes through
shared memory. Traffic goes to 127.0.0.1 only, but
the holder's (and every client's) transfer engine listens on every interface:
Mooncake 0.3.13 gives no way to bind it (docs/security.md). Needs the Mooncake
client (``lmkv-mooncake[cpu]``); nothing here imports the plugin.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary(name: str = "mooncake_master") -> str | None:
    """``mooncake_master`` (or ``name``) beside this Python, else on the PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


class MooncakePool:
    """A master and a holder lending ``segment_bytes``; ``options`` are the
    ``mooncake`` tier options of a pure client of it."""

    def __init__(self, tmp: str, segment_bytes: int = 256 << 20,
                 key_prefix: str = "lmkv:", real_client: bool = False) -> None:
        master = master_binary()
        if master is None:
            raise RuntimeError("mooncake_master not found: pip install 'lmkv-mooncake[cpu]'")
        rpc, http, metrics = _port(), _port(), _port()
        self.options = {"master_address": f"127.0.0.1:{rpc}",
                        "metadata_server": f"http://127.0.0.1:{http}/metadata",
                        "local_hostname": "127.0.0.1", "global_segment_size": 0,
                        "local_buffer_size": "64MiB", "key_prefix": key_prefix}
        log = open(os.path.join(tmp, "mooncake.log"), "ab")  # noqa: SIM115 (the processes own it)
        self.procs = [subprocess.Popen(
            [master, "--rpc_address", "127.0.0.1", "--rpc_port", str(rpc),
             "--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
             "--http_metadata_server_port", str(http), "--metrics_host", "127.0.0.1",
             "--metrics_port", str(metrics)], stdout=log, stderr=subprocess.STDOUT)]
        deadline = time.monotonic() + 30
        while not all(_answers(p) for p in (rpc, http)):
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"mooncake_master did not come up: see {log.name}")
            time.sleep(0.05)
        if real_client:
            self._start_real_client(log, segment_bytes, key_prefix)
            log.close()
            return
        holder = ("import sys; from mooncake.store import MooncakeDistributedStore as S; "
                  f"s = S(); code = s.setup('127.0.0.1', '{self.options['metadata_server']}', "
                  f"{segment_bytes}, 16 << 20, 'tcp', '', '127.0.0.1:{rpc}'); "
                  "print('ready' if code == 0 else code, flush=True); sys.stdin.read(); s.close()")
        self.procs.append(subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, text=True))
        log.close()
        if self.procs[-1].stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the Mooncake holder could not set up")

    def _start_real_client(self, log: object, segment_bytes: int, key_prefix: str) -> None:
        binary = master_binary("mooncake_client")
        if binary is None:
            self.close()
            raise RuntimeError("mooncake_client not found: pip install 'lmkv-mooncake[cpu]'")
        port = _port()
        self.procs.append(subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(port), "--master_server_address",
             self.options["master_address"], "--metadata_server",
             self.options["metadata_server"], "--global_segment_size",
             f"{segment_bytes >> 20}MB", "--protocol", "tcp"],
            stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while not _answers(port):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("mooncake_client did not come up")
            time.sleep(0.05)
        self.options = {"client_address": f"127.0.0.1:{port}", "local_buffer_size": "64MiB",
                        "key_prefix": key_prefix}

    @staticmethod
    def available() -> bool:
        """The Mooncake client, the plugin, ``mooncake_master`` and ``mooncake_client``
        are installed."""
        binaries = (master_binary(), master_binary("mooncake_client"))
        return None not in binaries and all(
            importlib.util.find_spec(m) is not None for m in ("mooncake", "lmkv_mooncake"))

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.stdin is not None:
                proc.stdin.close()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
