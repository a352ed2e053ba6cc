"""Loads of chunks a disk tier left in place (``lmkv.direct``) into the engine's KV.

A local engine opened with ``direct_reads`` hands a retrieve's chunks here
when some of them are ``DirectChunk``s. Runs of chunks in memory go to the
connector as usual. Direct chunks are read a few layers at a time (a piece) by
a reader thread into one of two staging buffers (allocated once, touched, so
reads never fault in fresh pages, and small enough to stay in the CPU's
caches) and folded into the chunk's checksum there, while this thread has the
connector (built for that many layers) copy the previous piece into the KV:
the disk read and the copy overlap.

A chunk whose read or checksum fails ends the load there: the caller gets the
chunks before it and recomputes the rest (the failed chunk's pieces may
already be in its blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import torch
import xxhash

from lmkv import affinity
from lmkv.direct import PIECE_BYTES, DirectChunk
from lmkv.errors import CorruptFrameError
from lmkv.gpu import ChunkSpan, GPUConnector
from lmkv.memory import MemoryObj

logger = logging.getLogger(__name__)

#: Staging buffers per load: one being read while the other is copied out.
SLOTS = 2
#: How long a load waits for one piece from the disk before giving up (a miss).
PIECE_TIMEOUT_S = 30.0


class DirectLoads:
    def __init__(self, connector: GPUConnector, piece_bytes: int = PIECE_BYTES) -> None:
        self.connector = connector
        self.piece_bytes = piece_bytes
        self._by_layers: dict[int, GPUConnector] = {connector.spec.num_layers: connector}
        self._lock = threading.Lock()
        self._spare: list[torch.Tensor] = []  # staging buffers no load holds
        self._reader = ThreadPoolExecutor(thread_name_prefix="lmkv-direct-read",
                                          initializer=affinity.apply)

    def load(self, spans: Sequence[ChunkSpan], objs: Sequence[MemoryObj | DirectChunk],
             kv: dict[str, Any]) -> int:
        """Copy ``spans`` (chunk ``i`` from ``objs[i]``) into the KV in order; the
        number of chunks loaded: all of them unless a direct chunk failed."""
        direct = [obj for obj in objs[:len(spans)] if isinstance(obj, DirectChunk)]
        slots = self._take_slots(max(chunk.layer_bytes for chunk in direct))
        piece_bytes = min(self.piece_bytes, *(slot.numel() for slot in slots))
        pipe = _Pipe(slots)
        job = self._reader.submit(_read_all, direct, piece_bytes, pipe)
        try:
            i, n = 0, len(spans)
            while i < n:
                if isinstance(objs[i], DirectChunk):
                    if not self._copy_chunk(pipe, spans[i], kv):
                        return i
                    i += 1
                    continue
                j = i
                while j < n and not isinstance(objs[j], DirectChunk):
                    j += 1
                self.connector.from_chunks(spans[i:j], **kv)
                i = j
            return n
        finally:
            pipe.stop()
            try:  # a reader that hung already is not waited for again
                job.result(timeout=0 if pipe.hung else PIECE_TIMEOUT_S)
            except FutureTimeout:  # its buffers stay with it; its chunks are released
                logger.warning("lmkv: a direct read did not end in %.0f s", PIECE_TIMEOUT_S)
            else:
                self._give_slots(slots)

    def _copy_chunk(self, pipe: _Pipe, span: ChunkSpan, kv: dict[str, Any]) -> bool:
        """Copy the next direct chunk's pieces as the reader delivers them; False
        when it failed (the tier has counted and logged it)."""
        want = span.end - span.start
        caches = kv["kv_caches"]
        while True:
            try:
                item = pipe.ready.get(timeout=PIECE_TIMEOUT_S)
            except queue.Empty:
                pipe.hung = True
                raise TimeoutError(f"lmkv: no direct read in {PIECE_TIMEOUT_S:.0f} s") from None
            if isinstance(item, BaseException):
                if isinstance(item, CorruptFrameError):
                    logger.debug("lmkv: %s; the load stops there", item)
                    return False
                raise item
            if item is None:  # the chunk is whole and verified
                return True
            first, piece, slot = item
            if piece.shape[2] > want:  # a chunk that holds more tokens than the hit
                piece = piece.narrow(2, 0, want)
            layers = piece.shape[0]
            self._connector(layers).from_chunks(
                [ChunkSpan(span.start, span.end, piece)],
                **{**kv, "kv_caches": caches[first:first + layers]})
            pipe.free.put(slot)

    def _take_slots(self, layer_bytes: int) -> list[torch.Tensor]:
        need = max(layer_bytes, self.piece_bytes // layer_bytes * layer_bytes)
        with self._lock:
            fit = [s for s in self._spare if s.numel() >= need][:SLOTS]
            for s in fit:
                self._spare.remove(s)
        while len(fit) < SLOTS:
            fit.append(torch.zeros(need, dtype=torch.uint8))  # touched: no faults later
        return fit

    def _give_slots(self, slots: list[torch.Tensor]) -> None:
        with self._lock:
            self._spare = (self._spare + slots)[-4 * SLOTS:]

    def _connector(self, layers: int) -> GPUConnector:
        """The engine's connector class, built for ``layers`` layers."""
        with self._lock:
            connector = self._by_layers.get(layers)
            if connector is None:
                whole = self.connector
                context = replace(whole.context, spec=replace(whole.spec, num_layers=layers))
                connector = self._by_layers[layers] = type(whole)(whole.options, context)
            return connector

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)


class _Pipe:
    """Pieces from the reader (``(first layer, view, slot)``, then None per chunk,
    or the exception that ended it) and the staging buffers back to it."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self.ready: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        for slot in slots:
            self.free.put(slot)
        self.stopped = threading.Event()
        self.hung = False  # a piece did not come in time

    def stop(self) -> None:
        self.stopped.set()
        self.free.put(None)  # wakes a reader waiting for a buffer


def _read_all(chunks: list[DirectChunk], piece_bytes: int, pipe: _Pipe) -> None:
    """The reader: every chunk's pieces in order, each into a free staging buffer."""
    for chunk in chunks:
        hasher = xxhash.xxh3_64()
        try:
            for first, layers in chunk.groups(piece_bytes):
                slot = pipe.free.get()
                if slot is None or pipe.stopped.is_set():
                    return
                pipe.ready.put((first, chunk.read_piece(first, layers, slot, hasher), slot))
            chunk.finish(hasher)
        except BaseException as exc:  # CorruptFrameError: told the tier; else a bug
            pipe.ready.put(exc)
            return
        pipe.ready.put(None)
