"""Read a file through a memory mapping, safe against the file shrinking under it.

A read through a mapping skips a copy (the page cache's pages are read where they
are), but a page the file no longer has (the file was truncated after it was
mapped, or the disk failed to read it) raises SIGBUS, which kills the process: a
cache must never turn a damaged file into a crashed engine. ``MappedFile`` maps
a file private (never written back) and registers the mapping with lmkv's SIGBUS
guard (``lmkv._ext._busguard``, a C extension): a fault inside the mapping
replaces the rest of it with zero pages and marks it ``damaged``, and the read
goes on, on zeros. A reader checks ``damaged`` after it has read what it needs
(the bytes it read are then garbage: treat them as never read) and verifies the
bytes as it would any it read (a checksum).

Files replaced by rename (how lmkv writes entries) never fault: the mapping
keeps the old file. ``MappedFile.open`` returns None where the guard is not
built (a platform without a compiler at install time), is full, or the file
cannot be mapped: read the file with ``pread`` then.

A mapping is unmapped when it is closed with no view of it alive, else at a
later ``open`` or ``close`` once none is; until then it stays guarded. The
mapping holds a descriptor of its own (Python's ``mmap`` duplicates the one
it is given): the caller may close its own at once.

``populate()`` faults every page of the mapping in at once (Linux 5.14's
``MADV_POPULATE_READ``, the GIL let go), waiting for the disk where pages are
missing: a file partly out of the page cache is then read through the mapping
without a fault (a synchronous read) per missing page. A file shorter than
its mapping makes it fail (False), never raise SIGBUS.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import types

from lmkv.memory import libc_madvise

logger = logging.getLogger(__name__)

_busguard: types.ModuleType | None
try:
    from lmkv._ext import _busguard
except ImportError:  # not built: mapped reads are off, pread serves
    _busguard = None

_lock = threading.Lock()
_lingering: list[MappedFile] = []  # closed while viewed: unmapped once they are not

#: madvise(MADV_POPULATE_READ), Linux 5.14 (22 is Linux's value; Python 3.11's
#: mmap has no name for it); refused once (an older kernel), never asked again.
_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)
_madvise = libc_madvise() if sys.platform.startswith("linux") else None
_POPULATE_REFUSED = [_madvise is None]


def can_populate() -> bool:
    """Whether ``MappedFile.populate`` can work here (as far as is known yet)."""
    return available() and not _POPULATE_REFUSED[0]


def available() -> bool:
    """Whether files can be mapped here with the SIGBUS guard."""
    return _busguard is not None


class MappedFile:
    """Bytes ``[start, start + length)`` of a file, mapped; ``view(offset, n)``
    gives ``n`` of them from ``start + offset`` without a copy (writable memory:
    writing changes this process's copy only)."""

    def __init__(self, mapping: mmap.mmap, slot: int, start: int, length: int) -> None:
        self._mapping: mmap.mmap | None = mapping
        self._slot = slot
        self._start = start
        self.length = length
        self._damaged_before = False  # (a fault seen under a slot given back since)

    @classmethod
    def open(cls, fd: int, start: int, length: int) -> MappedFile | None:
        """Map ``fd``'s bytes up to ``start + length``; None when they cannot be
        mapped under the guard (read them another way)."""
        if _busguard is None or length <= 0 or start < 0:
            return None
        _retry_lingering()
        try:
            mapping = mmap.mmap(fd, start + length, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            logger.debug("lmkv: could not map a file (%s); reading it instead", exc)
            return None
        try:
            slot = _busguard.guard(mapping)
        except BaseException:
            mapping.close()
            raise
        if slot < 0:  # the guard's table is full, or no handler could be installed
            mapping.close()
            return None
        return cls(mapping, slot, start, length)

    def populate(self) -> bool:
        """Fault every page of the mapped range in, reading what the page cache
        lacks from the disk (the GIL let go meanwhile); False where that failed:
        the file is shorter than the mapping, the disk failed, or the kernel
        has no such call (then never asked again). Nothing is read into this
        process's memory: the pages are the page cache's."""
        madvise = _madvise
        if madvise is None or _POPULATE_REFUSED[0] or self._mapping is None:
            return False
        holder = ctypes.c_char.from_buffer(self._mapping)  # (an export while it lives)
        try:
            base = ctypes.addressof(holder)
        finally:
            del holder
        page = mmap.PAGESIZE
        first = self._start // page * page
        end = self._start + self.length
        if madvise(base + first, end - first, _POPULATE_READ) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # a kernel without it (or a bad range)
            _POPULATE_REFUSED[0] = True
            logger.debug("lmkv: no populating of mappings here (%s); partly cached "
                         "entries are read with pread", os.strerror(err))
        return False

    @property
    def damaged(self) -> bool:
        """Whether a read of the mapping faulted (the file shrank, or its disk
        failed): what was read from it since is zeros, not the file's bytes."""
        if self._damaged_before:
            return True
        return self._slot >= 0 and _busguard is not None and bool(_busguard.damaged(self._slot))

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` bytes from ``start + offset``; valid until ``close``."""
        if self._mapping is None:
            raise ValueError("the mapping is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"bytes {offset}..{offset + nbytes} are outside the "
                             f"{self.length} mapped")
        begin = self._start + offset
        return memoryview(self._mapping)[begin:begin + nbytes]

    def close(self) -> None:
        """Unmap, now or, when a view of it is still alive, at a later ``open`` or
        ``close`` once none is (it stays guarded till then)."""
        _retry_lingering()
        if self._mapping is None:
            return
        if not self._unmap():
            with _lock:
                _lingering.append(self)

    def _unmap(self) -> bool:
        """Unmap unless viewed (False). The guard lets go of the range before it is
        unmapped, never after: addresses unmapped first could be mapped again by
        another thread while the guard still named them."""
        mapping = self._mapping
        if mapping is None:
            return True
        slot, self._slot = self._slot, -1
        damaged = False
        if slot >= 0 and _busguard is not None:
            damaged = bool(_busguard.release(slot))
        try:
            mapping.close()
        except BufferError:  # still viewed: guarded again, at once
            self._slot = _busguard.guard(mapping) if _busguard is not None else -1
            if damaged and self._slot >= 0:
                self._damaged_before = True
            return False
        self._mapping = None
        return True

    def __del__(self) -> None:
        # Collected without close(): unmap now, or keep it (and its guard) until
        # the views of the mmap, which do not hold this object, are gone.
        try:
            if not self._unmap():
                with _lock:
                    _lingering.append(self)
        except Exception:
            pass


def _retry_lingering() -> None:
    """Unmap the closed mappings that nothing views any more."""
    if not _lingering:
        return
    with _lock:
        _lingering[:] = [m for m in _lingering if not m._unmap()]

