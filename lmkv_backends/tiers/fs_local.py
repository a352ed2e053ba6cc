"""Entries of the ``fs`` tier on a local filesystem: one file per entry.

A write goes to a temporary file in the same directory (``pwritev`` of the
frame's buffers, no join), is flushed with ``fdatasync`` when durable (or when
its pages are to be handed back: ``page_cache`` off), and is renamed onto the
entry's name: a reader sees the whole entry or none of it. Temporaries left
by a crashed process are removed at start. A read parses the header, then
reads the payload straight into the chunk buffer.

Only regular files are entries. Names are checked with ``lstat`` and opened
with ``O_NOFOLLOW | O_NONBLOCK`` then ``fstat``-ed, so a symlink never serves
(not even to a valid entry elsewhere), a FIFO cannot block a reader, and a
directory is never a hit; such names raise ``NotAnEntry``. Files are created
with the tier's ``mode`` (0600 by default) and directories with the matching
execute bits (0700), whatever the umask.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.serde import FrameHeader, read_header, verify_payload
from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryObj, nbytes_of
from lmkv_backends.tiers.fs_index import NotAnEntry, key_of

logger = logging.getLogger(__name__)

TMP_PREFIX = ".lmkv-tmp."
# A temporary this old is stale even when its writer's pid cannot be checked
# (another host sharing the directory).
STALE_TMP_S = 3600.0
# Bytes per pwritev: the unit in which a durable write (or any write with page_cache
# off) is handed to the disk early.
# At most 1 MiB: a kernel that caches files in large folios (Linux 6.x on ext4)
# gives a larger write new folios of 2 MiB and more, and on a virtual machine
# whose host backs them lazily that cost 6-12x the CPU time (a new 4 MiB entry:
# about 9 ms written in one call, under 1 ms in pieces of 1 MiB; see
# docs/benchmarks.md, "What a write costs the kernel").
WRITE_SEGMENT = 1 << 20
# The first read of an entry: the header (under 100 bytes) and the page it is on.
HEAD_READ = 4096
_HOST = socket.gethostname().replace("/", "_") or "host"
# Opening an entry: never through a symlink, never waiting on a FIFO's writer.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: preadv2 flag: fail with EAGAIN rather than wait for the disk (0: not known here).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_NOWAIT_REFUSED = [False]  # set once a read with it was refused (EOPNOTSUPP, EINVAL)
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range, do not wait


class LocalStore:
    """Files in one directory; every method raises OSError (or CorruptFrameError)."""

    #: the index is trusted for hits; storage is consulted on index misses
    trust_index = True
    #: ``read_into`` reads a raw payload straight into a chunk buffer
    reads_into = True

    def __init__(self, root: str, durable: bool, page_cache: bool, file_mode: int,
                 dir_mode: int) -> None:
        """The settings are the tier's options (``fs_options``, where their defaults are)."""
        make_dirs(root, dir_mode)
        looser = stat.S_IMODE(os.stat(root).st_mode) & ~dir_mode & 0o077
        if looser:  # an existing directory keeps its mode: say what it exposes
            logger.warning("lmkv fs tier %s: the directory has mode %04o, more open than "
                           "the tier's %04o: other users may read or change its entries; "
                           "chmod %04o %s (and its files) to close it", root,
                           stat.S_IMODE(os.stat(root).st_mode), dir_mode, dir_mode, root)
        self.root = root
        self.durable = durable
        self.page_cache = page_cache
        self.file_mode = file_mode
        self.special_files = 0  # names that are not regular files, seen by scan

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    # -- start-up --------------------------------------------------------------
    def scan(self) -> list[tuple[CacheKey, int]]:
        """Entries in the directory, oldest first; stale temporaries are removed."""
        found: list[tuple[float, CacheKey, int]] = []
        with os.scandir(self.root) as it:
            for item in it:
                if item.name.startswith(TMP_PREFIX):
                    self._clean_temporary(item)
                    continue
                key = key_of(item.name)
                if key is None:
                    continue
                if not item.is_file(follow_symlinks=False):
                    self.special_files += 1
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda t: t[0])
        return [(key, size) for _, key, size in found]

    def _clean_temporary(self, item: os.DirEntry) -> None:
        parts = item.name[len(TMP_PREFIX):].rsplit(".", 2)  # host, pid, random
        host = parts[0] if len(parts) == 3 else ""
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        try:
            age = time.time() - item.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return
        if (host == _HOST and pid > 0 and not _alive(pid)) or age > STALE_TMP_S:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(item.path)
                logger.info("lmkv fs tier: removed stale temporary %s", item.path)

    # -- entries -----------------------------------------------------------------
    def stat(self, name: str) -> int | None:
        """The entry's size; None when absent; NotAnEntry when not a regular file."""
        try:
            st = os.lstat(self.path(name))
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise NotAnEntry(f"{name} is a {_kind(st.st_mode)}, not an entry file")
        return st.st_size

    def write(self, name: str, buffers: Sequence[bytes | memoryview]) -> int:
        """Write the frame atomically; the entry exists only once all of it is there."""
        tmp = self.path(f"{TMP_PREFIX}{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.file_mode)
        try:
            try:
                if self.file_mode & 0o060:  # a group mode the umask may have narrowed
                    os.fchmod(fd, self.file_mode)
                written = _write_all(fd, buffers, self._writeback(fd))
                if self.durable or not self.page_cache:  # (pages are dropped once clean)
                    os.fdatasync(fd)
                    self._release_pages(fd)  # clean now: they can go
            finally:
                os.close(fd)
            os.rename(tmp, self.path(name))
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return written

    def _writeback(self, fd: int) -> Callable[[int, int], None] | None:
        """How a write hands each segment to the disk early: dropping its pages as
        it goes (``page_cache`` off, durable or not: its pages can go only once
        clean), or, a durable write that keeps them, with ``sync_file_range``
        (none where the C library lacks it). None: the OS writes it back later."""
        if not self.page_cache:
            return partial(_start_writeback, fd)
        if not self.durable:
            return None
        return partial(_start_writeback_keeping, fd) if _sync_file_range else None

    def _release_pages(self, fd: int) -> None:
        """Hand the file's cached pages back. The chunk is in the memory tier above
        already, so a page-cache copy only doubles its memory; freed pages are
        also what the next read or write reuses instead of allocating new ones."""
        if not self.page_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def sync(self) -> None:
        """Make completed renames durable (one directory fsync for a batch)."""
        if not self.durable:
            return
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_into(self, name: str, key: CacheKey, serializer_id: int, allocate: Allocate
                  ) -> tuple[MemoryObj | None, int]:
        """Read a raw-payload frame straight into a buffer from ``allocate``.

        Returns (None, size) when ``allocate`` has no room. Raises
        FileNotFoundError for a missing entry and CorruptFrameError for one
        that fails to parse or verify.
        """
        fd, size = open_entry(self.path(name))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            head = os.pread(fd, min(size, HEAD_READ), 0)
            header = read_header(memoryview(head), key, size)
            _check_raw(header, serializer_id)
            try:
                obj = allocate(header.shape, header.dtype)
            except (ValueError, RuntimeError, OverflowError) as exc:  # a shape no view takes
                raise CorruptFrameError(f"shape {header.shape}: {exc}") from None
            if obj is None:
                return None, size
            try:
                payload = obj.byte_view().numpy().data
                start = header.header_len
                have = max(0, min(len(head) - start, len(payload)))
                payload[:have] = head[start:start + have]
                _read_exact(fd, payload[have:], start + have)
                self._release_pages(fd)
                verify_payload(header, payload)
            except BaseException:
                obj.ref_down()
                raise
            return obj, size
        finally:
            os.close(fd)

    def open_payload(self, name: str, key: CacheKey, serializer_id: int,
                     nowait: bool = False) -> tuple[tuple[int, FrameHeader, bool], int]:
        """Open a raw-payload frame and check its header (as ``read_into`` does):
        ``((descriptor, header, whether all of it is in the page cache), entry
        size)``; the payload is left to ``read_payload`` and the descriptor to the
        caller to close. Raises as ``read_into``; with ``nowait``, ``NotCached``
        when reading the header would wait for the disk."""
        fd, size = open_entry(self.path(name))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            want = min(size, HEAD_READ)
            if nowait:
                head = bytearray(want)
                try:
                    got = os.preadv(fd, [head], 0, _NOWAIT)
                except BlockingIOError:
                    got = -1
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    # A kernel or filesystem that cannot tell: never asked again,
                    # and this entry (as every one after) goes to the I/O threads.
                    _NOWAIT_REFUSED[0] = True
                    got = -1
                if got != want:  # (a short read: only part of it is cached)
                    # the disk starts on all of it now, before an I/O thread opens it
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    raise NotCached(name)
            else:
                head = os.pread(fd, want, 0)  # type: ignore[assignment]
            header = read_header(memoryview(head), key, size)
            _check_raw(header, serializer_id)
            # The disk starts reading the payload now, every entry of a lookup at
            # once, so the load (one piece after another) finds it in memory;
            # unless it is all in the page cache already (written or read lately:
            # asking costs a walk over every page of the entry).
            cached = _cached(fd, size)
            if not cached:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except BaseException:
            os.close(fd)
            raise
        return (fd, header, cached), size

    def read_payload(self, fd: int, header: FrameHeader, offset: int, view: memoryview
                     ) -> None:
        """Fill ``view`` with the payload's bytes from ``offset`` (CorruptFrameError
        when the entry ends before)."""
        if offset < 0 or offset + view.nbytes > header.payload_len:
            raise ValueError(f"bytes {offset}..{offset + view.nbytes} are outside the "
                             f"payload of {header.payload_len}")
        _read_exact(fd, view, header.header_len + offset)

    def close_payload(self, fd: int) -> None:
        """Give back a descriptor of ``open_payload`` (its pages too, without the
        page cache)."""
        try:
            if not self.page_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read_frame(self, name: str) -> bytearray:
        fd, size = open_entry(self.path(name))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            frame = bytearray(size)
            _read_exact(fd, memoryview(frame), 0)
            self._release_pages(fd)
            return frame
        finally:
            os.close(fd)

    def delete(self, name: str) -> bool:
        """Unlink the entry file; what is not a regular file is left alone."""
        if self.stat(name) is None:
            return False
        try:
            os.unlink(self.path(name))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        pass


def _check_raw(header: FrameHeader, serializer_id: int) -> None:
    """A raw-payload frame's header: written by ``serializer_id``, its payload
    exactly its shape and dtype, and not empty (CorruptFrameError otherwise)."""
    if header.serializer_id != serializer_id:
        raise CorruptFrameError(f"frame was written by serializer id "
                                f"{header.serializer_id}, not {serializer_id}")
    if header.payload_len != nbytes_of(header.shape, header.dtype):
        raise CorruptFrameError("payload length does not match dtype and shape")
    if not header.payload_len:
        raise CorruptFrameError(f"frame holds no elements (shape {header.shape})")


class NotCached(Exception):
    """An entry's header is not in the page cache (``open_payload``'s ``nowait``)."""


def can_tell_cached() -> bool:
    """Whether this kernel reads without waiting for the disk when asked (RWF_NOWAIT)."""
    return bool(_NOWAIT) and not _NOWAIT_REFUSED[0]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


#: cachestat(2), Linux 6.5: its number where lmkv knows it (x86-64 and the
#: architectures of the generic table; others number their calls apart).
_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_function(name: str) -> Callable[..., int] | None:
    """A function of this process's C library, errno kept (Linux only; ``os``
    lacks it); None where there is none."""
    if sys.platform != "linux":
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


_syscall = _libc_function("syscall")
if _syscall is not None:
    _syscall.restype = ctypes.c_long  # type: ignore[attr-defined]
_CACHESTAT_REFUSED = [_syscall is None or _CACHESTAT is None]


def _pages_cached(fd: int, size: int) -> bool | None:
    """Whether every page of a file of ``size`` bytes is in the page cache, from
    one ``cachestat`` call (about 30 us for 4 MiB); None where the kernel cannot
    tell (older than 6.5: remembered)."""
    pages = _pages_cached_count(fd, size)
    return None if pages is None else pages >= -(-size // _PAGE)


def _pages_cached_count(fd: int, size: int) -> int | None:
    """How many pages of the first ``size`` bytes of ``fd`` are in the page cache
    (``cachestat``); None where the kernel cannot tell."""
    if _CACHESTAT_REFUSED[0]:
        return None
    assert _syscall is not None
    stats, span = _CacheStat(), _CacheStatRange(0, size)
    if _syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stats), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # (EPERM: a seccomp filter)
            _CACHESTAT_REFUSED[0] = True
        return None
    return int(stats.nr_cache)


def _cached(fd: int, size: int) -> bool:
    """Whether a file of ``size`` bytes is in the page cache, every page of it (the
    kernel reclaims an idle file's pages piecemeal: its last byte may still be
    there when pages before it are gone); where ``cachestat`` is missing,
    whether its last byte is (read without waiting for the disk). False where
    the kernel cannot tell."""
    whole = _pages_cached(fd, size)
    if whole is not None:
        return whole
    if not can_tell_cached():
        return False
    try:
        return os.preadv(fd, [bytearray(1)], size - 1, _NOWAIT) == 1
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP: an older kernel
        return False


def open_entry(path: str) -> tuple[int, int]:
    """A read-only descriptor of the regular file at ``path`` and its size:
    FileNotFoundError when absent, NotAnEntry for a symlink, FIFO, directory or
    anything else."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISREG(mode):  # a regular file that could not be opened (EMFILE, EACCES)
            raise exc from None
        raise NotAnEntry(f"{os.path.basename(path)} is a {_kind(mode)}, not an entry file"
                         ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnEntry(f"{os.path.basename(path)} is a {_kind(st.st_mode)}, "
                             "not an entry file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def make_dirs(root: str, mode: int) -> None:
    """Create ``root`` and its missing parents with exactly ``mode`` (umask aside);
    existing directories keep theirs."""
    missing = []
    path = os.path.abspath(root)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            continue
        os.chmod(path, mode)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def _write_all(fd: int, buffers: Sequence[bytes | memoryview],
               written_back: Callable[[int, int], None] | None = None) -> int:
    """``pwritev`` the buffers back to back, ``WRITE_SEGMENT`` bytes per call;
    ``written_back(offset, length)`` is called after each segment."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    offset = 0
    while views:
        batch, room = [], WRITE_SEGMENT
        for view in views:
            batch.append(view[:room])
            room -= batch[-1].nbytes
            if not room:
                break
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(f"short write at offset {offset}")
        if written_back is not None:
            written_back(offset, n)
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done, want = 0, view.nbytes
    while done < want:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptFrameError("entry is shorter than its header says")
        done += n


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a segment back now (DONTNEED on dirty pages starts their
    writeback without waiting), so the disk works while the next segment is
    copied in, instead of everything waiting for the final fdatasync."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


_sync_file_range = _libc_function("sync_file_range")
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64,  # type: ignore[attr-defined]
                                 ctypes.c_int64, ctypes.c_uint)
    _sync_file_range.restype = ctypes.c_int  # type: ignore[attr-defined]


def _start_writeback_keeping(fd: int, offset: int, length: int) -> None:
    """Start writing a segment back now and leave its pages cached: the early
    writeback of ``_start_writeback`` for a tier that keeps the page cache."""
    if _sync_file_range is not None and _sync_file_range(fd, offset, length,
                                                         SYNC_FILE_RANGE_WRITE):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
