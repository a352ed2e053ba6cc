"""Shared-memory segments for the server's cpu arena.

The server creates one segment and places the cpu tier's arena in it; clients
on the same machine map it by the name the server hands out and copy chunk
bytes in and out with torch. Two kinds, tried in this order:

- **Huge pages** (Linux, where the host has them reserved: ``sysctl
  vm.nr_hugepages=N``): an anonymous ``memfd_create(MFD_HUGETLB)`` file. Its
  name is ``/proc/<pid>/fd/<n>``, which only processes allowed to inspect the
  server (its user, root) can open, and only while the server holds the fd; it
  needs no unlinking and nothing of it outlives the last mapping. Copies out of
  it take a TLB miss per 2 MiB instead of per 4 KiB (/dev/shm gets no
  transparent huge pages on most hosts), and a client fills its page tables
  with one fault per 2 MiB (``benchmarks/bench_shm_pages.py`` compares both).
  The name handed to clients also carries the memfd's full random name and its
  device and inode (``/proc/<pid>/fd/<n>#lmkv-<pid>-<hex>#<dev>:<ino>``): a
  client maps the descriptor only if it links to exactly that memfd and the file
  it opened is that inode. Without the check, a pid seen from another pid
  namespace on the same host (containers sharing hostname and boot id), or a
  pid reused, could name another lmkv server's arena.
- **/dev/shm** (``lmkv-<pid>-<random>``, 4 KiB pages): the creator unlinks the
  segment on close; if the creator is killed, Python's resource tracker (a
  helper process of the creator) unlinks it, so no segment outlives its server
  in /dev/shm.

When huge pages cannot be had, the segment says why (``no_huge_pages``), and
the lmkv server's listening line shows it. The free-memory
figures an arena is checked against (/dev/shm, the machine's memory) live here too.

Only stdlib and torch are imported here: the cpu tier imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import sys
from dataclasses import dataclass
from functools import cache
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from lmkv.base.errors import LMKVError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "lmkv-"
#: How a huge-page segment is named to clients: a descriptor of the server's, the
#: memfd's name, and the memfd's device and inode.
_HUGE_NAME = re.compile(rf"(/proc/\d+/fd/\d+)#({NAME_PREFIX}\d+-[0-9a-f]+)#(\d+):(\d+)")
#: The host setting that reserves huge pages (docs/server.md).
HUGE_PAGES_SETTING = "sysctl vm.nr_hugepages"


class SharedMemoryUnavailable(LMKVError):
    """A segment could not be created or mapped (no /dev/shm room, other machine)."""


@dataclass(frozen=True)
class HugePages:
    """The host's default huge pages (``/proc/meminfo``)."""

    page_size: int  # bytes
    total: int  # reserved (vm.nr_hugepages)
    available: int  # free and not promised to a mapping yet


def huge_pages() -> HugePages | None:
    """The host's huge pages; None where the kernel has none (not Linux)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                key, _, value = line.partition(":")
                if key.startswith(("HugePages_", "Hugepagesize")):
                    fields[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if "Hugepagesize" not in fields or "HugePages_Total" not in fields:
        return None
    return HugePages(page_size=fields["Hugepagesize"] * 1024, total=fields["HugePages_Total"],
                     available=fields.get("HugePages_Free", 0) - fields.get("HugePages_Rsvd", 0))


class SharedSegment:
    """One mapped segment and a flat uint8 tensor over it.

    ``name`` is what a client passes to ``attach``; ``page_size`` is the size of
    the pages behind it (``mmap.PAGESIZE``, or the huge page size);
    ``no_huge_pages`` says why a segment its creator made is not on huge pages
    ("" otherwise): the lmkv server's listening line shows it, the one line that
    says so (a line of its own would precede a start-up error's one line).
    """

    def __init__(self, name: str, buffer: SharedMemory | mmap.mmap, *, owner: bool,
                 page_size: int = mmap.PAGESIZE, fd: int = -1) -> None:
        self._buffer = buffer
        self._fd = fd  # a huge-page segment's memfd, held by its creator
        self.owner = owner
        self.name = name
        self.page_size = page_size
        self.no_huge_pages = ""
        view = buffer.buf if isinstance(buffer, SharedMemory) else buffer
        self.size = buffer.size if isinstance(buffer, SharedMemory) else len(buffer)
        self.tensor = torch.frombuffer(view, dtype=torch.uint8) if self.size else \
            torch.empty(0, dtype=torch.uint8)
        self._closed = False

    @property
    def huge_pages(self) -> bool:
        return self.page_size > mmap.PAGESIZE

    def file_id(self) -> tuple[int, int] | None:
        """(device, inode) of the file behind the segment, which is how
        ``/proc/<pid>/maps`` shows a process's mapping of it; None when it cannot
        be told (a segment this process attached to elsewhere, or gone)."""
        try:
            st = os.fstat(self._fd) if self._fd >= 0 else \
                os.stat(os.path.join(SHM_DIR, self.name))
        except (OSError, ValueError):
            return None
        return st.st_dev, st.st_ino

    @classmethod
    def create(cls, size: int, *, huge_pages: bool = True) -> SharedSegment:
        """A new segment of at least ``size`` bytes, on huge pages where the host has
        enough reserved (else ``no_huge_pages`` says why); SharedMemoryUnavailable when
        there is no room for it at all. ``huge_pages=False``: /dev/shm, not tried
        (benchmarks compare the two)."""
        if size <= 0:
            raise ValueError("size must be positive")
        segment, why_not = cls._create_huge(size) if huge_pages else (None, "")
        if segment is not None:
            return segment
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
        logger.debug("created shared-memory segment %s (%d bytes; %s)", name, size,
                     why_not or "huge pages not asked for")
        segment = cls(name, shm, owner=True)
        segment.no_huge_pages = why_not
        return segment

    @classmethod
    def _create_huge(cls, size: int) -> tuple[SharedSegment | None, str]:
        """A huge-page segment, or None and why not (for the log line)."""
        flag = getattr(os, "MFD_HUGETLB", None)
        pages = huge_pages()
        if flag is None or not hasattr(os, "memfd_create") or pages is None:
            return None, "this platform has no memfd huge pages"
        needed = -(-size // pages.page_size)
        available = max(pages.available, 0)
        if available < needed:
            return None, (f"huge pages: {available} of {pages.page_size >> 20} MiB available, "
                          f"the arena needs {needed}; reserve them with "
                          f"`{HUGE_PAGES_SETTING}={pages.total + needed - available}`")
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = -1
        try:
            fd = os.memfd_create(name, flag | os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, needed * pages.page_size)
            # A shared hugetlb mapping reserves its pages here: ENOMEM, never a
            # SIGBUS on a later first touch.
            mapping = mmap.mmap(fd, needed * pages.page_size, mmap.MAP_SHARED)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            return None, f"huge pages: {exc.strerror or exc}"
        logger.debug("created huge-page segment %s (%d bytes)", name, len(mapping))
        return cls(huge_segment_name(f"/proc/{os.getpid()}/fd/{fd}", name, os.fstat(fd)),
                   mapping, owner=True, page_size=pages.page_size, fd=fd), ""

    @classmethod
    def attach(cls, name: str, min_size: int = 0) -> SharedSegment:
        """Map an existing segment (never unlinked by this process)."""
        if name.startswith("/"):
            return cls._attach_huge(name, min_size)
        try:
            if sys.version_info >= (3, 13):
                shm = SharedMemory(name=name, track=False)
            else:
                shm = SharedMemory(name=name)
                # Before 3.13 attaching registers the segment with this process's
                # resource tracker, which would unlink it when this process exits.
                # The private ``_name`` (with its "/") is what the tracker registered.
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except (OSError, ValueError) as exc:
            raise SharedMemoryUnavailable(f"shared memory: cannot map {name!r}: {exc}") from None
        if shm.size < min_size:
            shm.close()
            raise SharedMemoryUnavailable(
                f"shared memory: {name!r} has {shm.size} bytes, expected {min_size}")
        return cls(name, shm, owner=False)

    @classmethod
    def _attach_huge(cls, name: str, min_size: int) -> SharedSegment:
        """Map a huge-page segment through its creator's descriptor. Only the memfd
        the name describes is mapped: a descriptor linking anywhere else (a file of
        this user, another server's memfd under a pid seen from another namespace
        or reused) is refused rather than written into."""
        match = _HUGE_NAME.fullmatch(name)
        if match is None:
            raise SharedMemoryUnavailable(f"shared memory: {name!r} is not a segment name")
        path, memfd, dev, ino = match.groups()
        try:
            # Linux shows a memfd's link as "/memfd:<name> (deleted)".
            if os.readlink(path) != f"/memfd:{memfd} (deleted)":
                raise SharedMemoryUnavailable(
                    f"shared memory: {name!r} is not that lmkv segment")
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"shared memory: cannot map {name!r}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (int(dev), int(ino)):  # (relinked meanwhile)
                raise SharedMemoryUnavailable(
                    f"shared memory: {name!r} is not that lmkv segment")
            size = st.st_size
            if size < max(min_size, 1):
                raise SharedMemoryUnavailable(
                    f"shared memory: {name!r} has {size} bytes, expected {min_size}")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as exc:
            raise SharedMemoryUnavailable(
                f"shared memory: cannot map {name!r}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)  # the mapping keeps the memory
        pages = huge_pages()
        return cls(name, mapping, owner=False,
                   page_size=pages.page_size if pages else mmap.PAGESIZE)

    def close(self) -> None:
        """Unmap (the creator also unlinks or closes its memfd); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owner and isinstance(self._buffer, SharedMemory):
            with contextlib.suppress(FileNotFoundError):
                self._buffer.unlink()
        if self._fd >= 0:
            os.close(self._fd)  # no new client can open it; mappings stay valid
            self._fd = -1
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._buffer.close()
        except BufferError:
            # Views of the arena are still alive somewhere; the mapping goes with the
            # process. The name is unlinked already, so nothing leaks in /dev/shm.
            logger.debug("segment %s still has views; left mapped", self.name)

    def __repr__(self) -> str:
        return (f"SharedSegment({self.name!r}, size={self.size}, owner={self.owner}, "
                f"page_size={self.page_size})")


def huge_segment_name(path: str, memfd_name: str, st: os.stat_result) -> str:
    """What clients are handed for a memfd segment: the descriptor's ``path``, the
    memfd's name, and its device and inode (``st``), checked by ``attach``."""
    return f"{path}#{memfd_name}#{st.st_dev}:{st.st_ino}"


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
