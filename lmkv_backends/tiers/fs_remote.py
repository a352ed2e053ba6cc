"""Entries of the ``fs`` tier on a remote fsspec filesystem (S3 and others).

Objects are written whole (a PUT is atomic on S3) and read whole. A request
the remote does not answer (or answers with anything but "no such object")
raises ``TierUnavailable``: the tier's fault policy then opens its breaker,
and every request here waits for it (``lmkv.contracts.faults``).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from lmkv.contracts.faults import TierFaults, TierUnavailable
from lmkv.keys.chunking import CacheKey
from lmkv_backends.tiers.fs_index import NotAnEntry, key_of
from lmkv_backends.tiers.fs_options import RemoteLocation

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RemoteStore:
    """Objects under ``root`` of an fsspec filesystem; every method may raise."""

    trust_index = False  # other processes add and remove objects: ask the remote
    reads_into = False

    def __init__(self, location: RemoteLocation, faults: TierFaults) -> None:
        self.fs = location.fs
        self.root = location.root
        self.faults = faults  # the tier's: its breaker guards every request

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self.faults.check()
        try:
            result = fn(*args)
        except (FileNotFoundError, IsADirectoryError):
            self.faults.succeeded()  # the remote answered
            raise
        except Exception as exc:
            raise TierUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.faults.succeeded()
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
