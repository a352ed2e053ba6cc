"""Entries of the ``fs`` tier on a remote fsspec filesystem (S3 and others).

Objects are written whole (a PUT is atomic on S3) and read whole. After a
failed request the remote is considered down for a short, growing interval:
operations then fail at once instead of each waiting for a timeout, and one
probe at a time tests whether the remote is back.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from lmkv.tokens import CacheKey
from lmkv_backends.tiers.fs_index import NotAnEntry, key_of
from lmkv_backends.tiers.fs_options import RemoteLocation

logger = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_BACKOFF_S = 0.25
LONGEST_BACKOFF_S = 2.0


class RemoteUnavailable(OSError):
    """The remote failed recently; the operation was not attempted."""


class Breaker:
    """Fails fast while the remote is down; lets one probe through per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._until = 0.0
        self._reason = ""

    def check(self) -> None:
        if not self._backoff:
            return
        with self._lock:
            now = time.monotonic()
            if now < self._until:
                raise RemoteUnavailable(f"remote unavailable ({self._reason}); "
                                        f"retrying within {self._until - now:.1f}s")
            self._until = now + self._backoff  # this caller probes; the others wait

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self._backoff = min(LONGEST_BACKOFF_S, self._backoff * 2 or FIRST_BACKOFF_S)
            self._until = time.monotonic() + self._backoff
            self._reason = f"{type(exc).__name__}: {exc}"[:200]

    def succeeded(self) -> None:
        if self._backoff:
            with self._lock:
                self._backoff = self._until = 0.0


class RemoteStore:
    """Objects under ``root`` of an fsspec filesystem; every method may raise."""

    trust_index = False  # other processes add and remove objects: ask the remote
    reads_into = False

    def __init__(self, location: RemoteLocation) -> None:
        self.fs = location.fs
        self.root = location.root
        self.breaker = Breaker()

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self.breaker.check()
        try:
            result = fn(*args)
        except (FileNotFoundError, IsADirectoryError):
            self.breaker.succeeded()  # the remote answered
            raise
        except Exception as exc:
            self.breaker.failed(exc)
            raise
        self.breaker.succeeded()
        return result

    def scan(self) -> list[tuple[CacheKey, int]]:
        """Entries under the root, oldest first (when the filesystem says)."""
        try:
            listing = self._call(self.fs.ls, self.root, True)
        except FileNotFoundError:
            return []
        found = []
        for info in listing:
            key = key_of(posixpath.basename(info["name"].rstrip("/")))
            if key is not None and info.get("type", "file") == "file":
                found.append((_mtime(info), key, int(info.get("size") or 0)))
        found.sort(key=lambda t: t[0])
        return [(key, size) for _, key, size in found]

    def stat(self, name: str) -> int | None:
        try:
            info = self._call(self.fs.info, self.path(name))
        except FileNotFoundError:
            return None
        kind = info.get("type", "file")
        if kind != "file":  # a "directory" (a prefix on S3), a link, ...
            raise NotAnEntry(f"{name} is a {kind}, not an entry object")
        return int(info["size"])

    def write(self, name: str, buffers: Sequence[bytes | memoryview]) -> int:
        data = b"".join(buffers)
        self._call(self.fs.pipe_file, self.path(name), data)
        return len(data)

    def sync(self) -> None:
        pass  # a completed PUT is durable

    def read_frame(self, name: str) -> bytes:
        try:
            return self._call(self.fs.cat_file, self.path(name))
        except IsADirectoryError:
            raise NotAnEntry(f"{name} is a directory, not an entry object") from None

    def delete(self, name: str) -> bool:
        try:
            self._call(self.fs.rm_file, self.path(name))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        pass  # sessions close with the filesystem object; nothing here may block


def _mtime(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0
