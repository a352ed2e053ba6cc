"""Memory the store may read from and write to without a staging copy.

Mooncake moves bytes between registered buffers (RDMA requires it; over TCP it
lets the transfer engine read in place). The tier registers its own staging
arena at setup and, with ``register_arena``, the arena each chunk it is handed
comes from (lmkv's cpu tier: one registration for all its chunks), so a put
reads the chunk where it lies.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def address(buffer: object) -> tuple[int, int]:
    """(address, length) of a contiguous buffer (bytes, memoryview, ndarray)."""
    array = np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]
    return array.ctypes.data, array.nbytes


class Registered:
    """The spans registered with one store (sorted, non-overlapping)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()
        self._refused: set[int] = set()

    def covers(self, ptr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._ends[i]

    def register(self, store: Any, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` once; False when the store refuses it
        (then it is not asked again: the tier copies through staging instead)."""
        with self._lock:
            if self.covers(ptr, nbytes):
                return True
            if ptr in self._refused:
                return False
            code = store.register_buffer(ptr, nbytes)
            if code != 0:
                self._refused.add(ptr)
                logger.warning("lmkv mooncake tier: registering %d bytes at %#x answered %d;"
                               " chunks there go through staging", nbytes, ptr, code)
                return False
            i = bisect.bisect_right(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + nbytes)
            return True

    def unregister(self, store: Any, ptr: int) -> None:
        """Forget the span starting at ``ptr`` (its memory is about to be freed)."""
        with self._lock:
            if ptr not in self._starts:
                return
            i = self._starts.index(ptr)
            del self._starts[i], self._ends[i]
            code = store.unregister_buffer(ptr)
            if code != 0:
                logger.warning("lmkv mooncake tier: unregistering %#x answered %d", ptr, code)
