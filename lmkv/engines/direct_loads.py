"""Loads of chunks a disk tier left in place (``lmkv.contracts.direct_chunk``) into the engine's KV.

A local engine opened with ``direct_reads`` hands a retrieve's chunks here
when some of them are ``DirectChunk``s. Runs of chunks in memory go to the
connector as usual. A direct chunk is read a few layers at a time (a piece)
into a staging buffer (allocated once and touched, so reads never fault in
fresh pages, and small enough to stay in the CPU's caches), folded into the
chunk's checksum there, and copied from there into the KV by the same
connector built for that many layers. A chunk its tier mapped is copied from
the mapping, with no staging buffer (``DirectChunk.mapped``); where the
connector checks chunks as it copies them (``GPUConnector.from_checked_chunks``:
the ``paged`` connector into vLLM's CPU caches), a run of mapped chunks goes to
it whole, in one call: each chunk read once, by one thread of the copy's.

The reads run on the calling thread. A reader thread that fetched the next
piece while this one copied measured slower inside vLLM's CPU build (its
OpenMP threads, one per CPU, copy; a third thread only takes a CPU from one of
them): 60 against 50 ms of load for 4096 tokens.

A chunk whose read or checksum fails ends the load there: the caller gets the
chunks before it and recomputes the rest (the failed chunk's pieces may
already be in its blocks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.connector import ChunkSpan, GPUConnector, checked_loads
from lmkv.contracts.direct_chunk import PIECE_BYTES, DirectChunk
from lmkv.memory import MemoryObj

logger = logging.getLogger(__name__)
_NO_STAGING = torch.empty(0, dtype=torch.uint8)


class DirectLoads:
    def __init__(self, connector: GPUConnector, piece_bytes: int = PIECE_BYTES) -> None:
        self.connector = connector
        self.piece_bytes = piece_bytes
        self._by_layers: dict[int, GPUConnector] = {connector.spec.num_layers: connector}
        self._checker = checked_loads(connector)
        self._lock = threading.Lock()
        self._spare: list[torch.Tensor] = []  # staging buffers no load holds

    def load(self, spans: Sequence[ChunkSpan], objs: Sequence[MemoryObj | DirectChunk],
             kv: dict[str, Any]) -> int:
        """Copy ``spans`` (chunk ``i`` from ``objs[i]``) into the KV in order; the
        number of chunks loaded: all of them unless a direct chunk failed."""
        read = [obj.layer_bytes for obj in objs[:len(spans)]
                if isinstance(obj, DirectChunk) and not obj.mapped]
        # (mapped chunks' pieces are views of their mappings: no staging buffer)
        staging = self._take(max(read)) if read else _NO_STAGING
        try:
            i, n = 0, len(spans)
            checks = self._checker is not None  # (until the connector declines once)
            while i < n:
                if isinstance(objs[i], DirectChunk):
                    checked = self._checked(spans, objs, i, kv) if checks else None
                    if isinstance(checked, tuple):  # a run of mapped chunks, copied, checked
                        i, whole = checked
                        if not whole:
                            return i
                        continue
                    checks = checks and checked is None  # (declined: not asked again)
                    try:
                        self._read(objs[i], spans[i], staging, kv)  # type: ignore[arg-type]
                    except CorruptFrameError as exc:  # the tier has counted and logged it
                        logger.debug("lmkv: %s; the load stops there", exc)
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
            if read:
                self._give(staging)

    def _checked(self, spans: Sequence[ChunkSpan], objs: Sequence[MemoryObj | DirectChunk],
                 i: int, kv: dict[str, Any]) -> tuple[int, bool] | bool | None:
        """The run of mapped chunks from ``objs[i]`` on, copied and checked by the
        connector in one call (``checked_loads``): the index after the chunks
        loaded, and whether all of them were; nothing copied: None where
        ``objs[i]`` is not mapped, False where the connector declined them."""
        checker = self._checker
        if checker is None:
            return None
        j = i
        while j < len(spans) and isinstance(objs[j], DirectChunk) and objs[j].mapped:  # type: ignore[union-attr]
            j += 1
        run: list[DirectChunk] = objs[i:j]  # type: ignore[assignment]
        if not run:
            return None
        whole = [ChunkSpan(span.start, span.end, chunk.mapping())
                 for span, chunk in zip(spans[i:j], run, strict=True)]
        answer = checker(whole, [chunk.checksum for chunk in run], **kv)
        del whole  # (the mappings' views: a released chunk unmaps once they are gone)
        if answer is None:
            return False
        verdicts = _verdicts(answer, len(run))
        if verdicts is None:  # the connector's fault, not the entries': read them here
            logger.warning("lmkv: gpu_connector %r answered a checked load of %d chunks with "
                           "%.80r, not a bool for each; lmkv checks its loads itself from now "
                           "on", getattr(self.connector, "name", "?"), len(run), answer)
            self._checker = None
            return False
        for k, (chunk, matched) in enumerate(zip(run, verdicts, strict=True)):
            try:
                chunk.finish_checked(matched)
            except CorruptFrameError as exc:  # the tier has counted and logged it
                logger.debug("lmkv: %s; the load stops there", exc)
                return i + k, False
        return j, True

    def _read(self, chunk: DirectChunk, span: ChunkSpan, staging: torch.Tensor,
              kv: dict[str, Any]) -> None:
        want = span.end - span.start
        caches = kv["kv_caches"]
        for first, piece in chunk.pieces(staging, self.piece_bytes):
            if piece.shape[2] > want:  # a chunk that holds more tokens than the hit
                piece = piece.narrow(2, 0, want)
            layers = piece.shape[0]
            self._connector(layers).from_chunks(
                [ChunkSpan(span.start, span.end, piece)],
                **{**kv, "kv_caches": caches[first:first + layers]})

    def _take(self, layer_bytes: int) -> torch.Tensor:
        """A staging buffer for pieces of whole layers of ``layer_bytes`` each."""
        need = max(layer_bytes, self.piece_bytes // layer_bytes * layer_bytes)
        with self._lock:
            for staging in self._spare:
                if staging.numel() >= need:
                    self._spare.remove(staging)
                    return staging
        return torch.zeros(need, dtype=torch.uint8)  # touched: no faults later

    def _give(self, staging: torch.Tensor) -> None:
        with self._lock:
            self._spare = [*self._spare, staging][-4:]

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
        with self._lock:
            self._spare = []


def _verdicts(answer: object, n: int) -> list[bool] | None:
    """A checked load's answer as ``n`` bools (numpy's too), or None when it is not one."""
    try:
        verdicts = list(answer)  # type: ignore[call-overload]
    except TypeError:
        return None
    if len(verdicts) != n or not all(isinstance(v, (bool, np.bool_)) for v in verdicts):
        return None
    return [bool(v) for v in verdicts]
