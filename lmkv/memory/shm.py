"""Named shared-memory segments for the server's cpu arena.

The server creates one segment (``lmkv-<pid>-<random>``) and places the cpu
tier's arena in it; clients on the same machine map it by name and copy chunk
bytes in and out with torch. The creator unlinks the segment on close; if the
creator is killed, Python's resource tracker (a helper process of the
creator) unlinks it, so no segment outlives its server in /dev/shm. The free-memory figures an
arena is checked against (/dev/shm, the machine's memory) live here too.

Only stdlib and torch are imported here: the cpu tier imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
from functools import cache
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from lmkv.errors import LMKVError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "lmkv-"


class SharedMemoryUnavailable(LMKVError):
    """A segment could not be created or mapped (no /dev/shm room, other machine)."""


class SharedSegment:
    """One mapped segment and a flat uint8 tensor over it."""

    def __init__(self, shm: SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.name = shm.name.lstrip("/")
        self.size = shm.size
        self.tensor = torch.frombuffer(shm.buf, dtype=torch.uint8) if shm.size else \
            torch.empty(0, dtype=torch.uint8)
        self._closed = False

    @classmethod
    def create(cls, size: int) -> SharedSegment:
        """A new segment of ``size`` bytes; SharedMemoryUnavailable when there is no room."""
        if size <= 0:
            raise ValueError("size must be positive")
        free = _free_shm_bytes()
        if free is not None and free < size:
            # tmpfs would accept the segment and SIGBUS on the first write past its room.
            raise SharedMemoryUnavailable(
                f"shared memory: {SHM_DIR} has {free} bytes free, the arena needs {size}")
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            shm = SharedMemory(name=name, create=True, size=size)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"shared memory: cannot create a segment of {size} bytes: "
                f"{exc.strerror or exc}") from None
        logger.debug("created shared-memory segment %s (%d bytes)", name, size)
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str, min_size: int = 0) -> SharedSegment:
        """Map an existing segment (never unlinked by this process)."""
        try:
            if sys.version_info >= (3, 13):
                shm = SharedMemory(name=name, track=False)
            else:
                shm = SharedMemory(name=name)
                # Before 3.13 attaching registers the segment with this process's
                # resource tracker, which would unlink it when this process exits.
                resource_tracker.unregister(shm._name, "shared_memory")
        except (OSError, ValueError) as exc:
            raise SharedMemoryUnavailable(f"shared memory: cannot map {name!r}: {exc}") from None
        if shm.size < min_size:
            shm.close()
            raise SharedMemoryUnavailable(
                f"shared memory: {name!r} has {shm.size} bytes, expected {min_size}")
        return cls(shm, owner=False)

    def close(self) -> None:
        """Unmap (the creator also unlinks); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._shm.close()
        except BufferError:
            # Views of the arena are still alive somewhere; the mapping goes with the
            # process. The name is unlinked already, so nothing leaks in /dev/shm.
            logger.debug("segment %s still has views; left mapped", self.name)

    def __repr__(self) -> str:
        return f"SharedSegment({self.name!r}, size={self.size}, owner={self.owner})"


def _free_shm_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def available_memory_bytes() -> int | None:
    """Memory the kernel can give without swapping (Linux ``MemAvailable``); elsewhere
    the free physical pages; None when neither is known (then nothing is checked)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


@cache
def host_id() -> str:
    """Names this machine (and boot): a client maps the server's segment only when equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
