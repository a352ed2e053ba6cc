"""``spawn_server``: a real ``lmkv server`` process on a free loopback port."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from lmkv.rpc.client import ServerClient


def spawn_server(directory: str | os.PathLike, tiers_yaml: str, *,
                 env: Mapping[str, str] | None = None,
                 timeout_s: float = 60.0, args: Sequence[str] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """Start ``python -m lmkv.server`` serving ``tiers_yaml`` (a config file's text)
    on a free 127.0.0.1 port; wait until it answers. Returns the process (stop it
    with ``terminate()``: exit code 0 once drained) and its address. The config
    and the log (``server-<port>.log``) go to ``directory``; ``args``: more flags
    (``--metrics-port``, say)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = os.path.join(directory, f"server-{port}.yaml")
    with open(config, "w") as f:
        f.write(tiers_yaml)
    with open(os.path.join(directory, f"server-{port}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmkv.server", "--config", config,
                                 "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None)
    address = f"tcp://127.0.0.1:{port}"
    client_log = logging.getLogger("lmkv.rpc.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)  # "no server" misses until it is up
    try:
        with ServerClient(address, timeout_ms=500) as client:
            deadline = time.monotonic() + timeout_s
            while client.ping() is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"the lmkv server did not start (log: {log.name})")
                time.sleep(0.1)
    finally:
        client_log.setLevel(level)
    return proc, address
