"""Service processes a test starts on loopback ports, waits for, kills and stops,
and what this process itself listens on.

``Service`` is the base of the real servers ``lmkv.testing.redis`` and
``lmkv.testing.mooncake`` start: each runs in a session of its own (a kill
takes its children too), waits a bounded time for its ports, and ``stop``
always ends it (SIGTERM, then SIGKILL), even one paused with ``pause``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

#: How long a service may take to listen (a liveness bound).
START_TIMEOUT_S = 30.0
#: How long ``stop`` waits after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 10.0


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (with ``with_bus``, one whose port + 10000 is free too:
    a Redis Cluster node's bus port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


class Service:
    """A process a test started: ``wait_for`` its ports, ``kill``, ``pause``,
    ``resume``, ``stop``."""

    proc: subprocess.Popen | None = None

    def launch(self, argv: list[str], log: Path, cwd: Path | None = None) -> None:
        """Start ``argv`` in a session of its own, its output appended to ``log``."""
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                         start_new_session=True)

    def wait_for(self, ports: tuple[int, ...], what: str, log: Path,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every one of ``ports`` accepts connections; RuntimeError (naming
        ``log``, with its tail) when the process exits or ``timeout_s`` passes."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not all(listening(port) for port in ports):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited: {_tail(log)}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{what} did not come up in {timeout_s:g} s: {_tail(log)}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to its whole session: it vanishes mid-whatever."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # (gone meanwhile)
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (a paused one resumed first), SIGKILL past ``STOP_TIMEOUT_S``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()


def _tail(log: Path) -> str:
    try:
        return f"{log}: ...{log.read_text(errors='replace')[-1500:]}"
    except OSError:
        return f"{log} (unreadable)"


def listening_addresses() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from
    /proc/net/tcp{,6} matched by inode against /proc/self/fd (Linux only)."""
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
    """The addresses that are not loopback (nor IPv4 loopback mapped into IPv6)."""
    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    return [(a, p) for a, p in addresses if not loopback(a)]
