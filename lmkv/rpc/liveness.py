"""Is a client process still there? What lets the server free quarantined memory.

A client that maps the server's shared-memory arena names its process in the
requests that lend it arena buffers: ``host|pid namespace|pid|start time``.
The server can tell that such a process is gone only when it runs on the
same host (hostname and boot id) in the same pid namespace: then the pid is
its pid too, and a missing ``/proc/<pid>``, a zombie, or another start time
(the pid was reused) means the process has exited, and with it its mappings.
Anything else (another namespace, no ``/proc``, a client that named no
process) is ``unknown``: the server cannot know, and waits.

A client can name any process, so the server does not take the name on trust
(lmkv.server.service): on an ipc socket the kernel tells it the peer's pid
(``SO_PEERCRED``, which ZMQ appends to the connection's peer address), and
``pid_identity`` names that process; elsewhere a named process counts only if
it maps the server's arena (``maps_file``): a process that does not map it
cannot be the one copying, however long it lives.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Literal

from lmkv.memory.shm import host_id

logger = logging.getLogger(__name__)

ProcessState = Literal["alive", "gone", "unknown"]


@cache
def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid``; None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], fields[19]


_identity: tuple[int, str] | None = None


def process_identity() -> str:
    """This process, as the server can check it; "" where it cannot be named."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:  # computed again in a forked child
        namespace = _pid_namespace()
        stat = _stat(pid) if namespace else None
        _identity = (pid, f"{host_id()}|{namespace}|{pid}|{stat[1]}" if stat else "")
    return _identity[1]


def process_state(identity: str) -> ProcessState:
    """Whether the process ``identity`` names still runs, as far as this process can tell."""
    parts = identity.split("|")
    if len(parts) != 4 or not parts[2].isdigit() or parts[0] != host_id() \
            or not parts[1] or parts[1] != _pid_namespace():
        return "unknown"
    try:
        stat = _stat(int(parts[2]))
    except (OSError, IndexError):
        return "unknown"
    if stat is None or stat[0] in ("Z", "X") or stat[1] != parts[3]:
        return "gone"
    return "alive"


def pid_identity(pid: int) -> str:
    """The process ``pid`` of this pid namespace (as the kernel names a socket peer
    to this process), named as ``process_identity`` names itself; "" when it cannot
    be named (gone, or no ``/proc``)."""
    namespace = _pid_namespace()
    try:
        stat = _stat(pid) if namespace and pid > 0 else None
    except (OSError, IndexError):
        stat = None
    return f"{host_id()}|{namespace}|{pid}|{stat[1]}" if stat else ""


def claimed_pid(identity: str) -> int | None:
    """The pid an identity names, when it is one of this host's and pid namespace's."""
    parts = identity.split("|")
    if len(parts) != 4 or not parts[2].isdigit() or parts[0] != host_id() \
            or not parts[1] or parts[1] != _pid_namespace():
        return None
    return int(parts[2])


def maps_file(identity: str, file_id: tuple[int, int]) -> bool:
    """Whether the live process ``identity`` names has the file ``file_id`` (device,
    inode) mapped; False when it has not, is gone, or cannot be inspected."""
    pid = claimed_pid(identity)
    if pid is None or process_state(identity) != "alive":
        return False
    dev, ino = file_id
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or fields[4] != b"%d" % ino:
                    continue
                major, _, minor = fields[3].partition(b":")
                if (int(major, 16), int(minor, 16)) == (os.major(dev), os.minor(dev)):
                    return process_state(identity) == "alive"  # not reused meanwhile
    except (OSError, ValueError):
        return False
    return False
