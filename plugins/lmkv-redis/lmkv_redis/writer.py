"""Puts of the redis tier: asynchronous, one pipeline per ``pipeline_bytes``.

``submit`` (``lmkv.contracts.put_queue.PutQueue``) takes a reference on every MemoryObj
and returns at once; a background thread serializes each chunk (the frame's payload is a view of the
chunk's memory: nothing is copied on the way to the socket), writes the batch
and then releases the references. A write that fails is dropped and counted;
the future resolves to the number of entries stored and never raises for a
Redis fault. The writer holds the connection, the serializer and the tier's
fault policy (with its counters), never the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lmkv.contracts import CacheKey, MemoryObj, PutQueue, Serializer
from lmkv_redis.connection import Connection
from lmkv_redis.layout import envelope, part_names, split
from lmkv_redis.wire import bulk

logger = logging.getLogger(__name__)


class Writer(PutQueue):
    def __init__(self, connection: Connection, serializer: Serializer) -> None:
        super().__init__(connection.faults, connection.options.max_pending_bytes,
                         "lmkv-redis-put")
        self.connection = connection
        self.serializer = serializer
        self.options = connection.options

    @property
    def usable(self) -> bool:
        return self.connection.usable

    # -- writing (background thread) ------------------------------------------------
    def _write(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        counters = self.counters
        stored = start = 0
        while start < len(keys):
            end, window_bytes = start, 0
            while end < len(keys) and (end == start or window_bytes + objs[end].nbytes
                                       <= self.options.pipeline_bytes):
                window_bytes += objs[end].nbytes
                end += 1
            left = len(keys) - start
            written = None
            with self.faults.guard("put", f"dropping {left} writes"):
                written = self._write_window(keys[start:end], objs[start:end])
            if written is None:
                counters.dropped_writes += left
                break
            stored += written
            start = end
        counters.puts += stored
        return stored

    def _write_window(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        counters, serializer = self.counters, self.serializer
        part_bytes = int(self.options.part_bytes)
        ttl = ["PX", max(1, round(self.options.ttl_s * 1000))] if self.options.ttl_s else []
        pipe = self.connection.pipeline()
        plan: list[tuple[str, list[str], int]] = []
        for key, obj in zip(keys, objs, strict=True):
            buffers = serializer.serialize(obj, key)
            frame_len = sum(memoryview(b).nbytes for b in buffers)
            name = self.connection.main_key(key)
            pieces: Sequence[Sequence[bytes | memoryview]] = (
                split(buffers, part_bytes) if frame_len > part_bytes else [buffers])
            parts = part_names(self.options.key_prefix, name, len(pieces))
            if not parts:
                pieces = [buffers]
            pipe.execute_command("EXISTS", name)  # tells usage whether the entry is new
            for part, piece in zip(parts, pieces[1:], strict=True):
                pipe.execute_command("SET", part, bulk(piece), *ttl)
            head = [envelope(len(pieces), frame_len), *pieces[0]] if parts else pieces[0]
            pipe.execute_command("SET", name, bulk(head), *ttl)  # last: readers see whole entries
            plan.append((name, parts, frame_len))
        replies = self.connection.execute(pipe)

        stored, pos, failed = 0, 0, []
        for name, parts, frame_len in plan:
            existed, *sets = replies[pos:pos + 2 + len(parts)]
            pos += 2 + len(parts)
            if all(r is True for r in sets):
                stored += 1
                counters.bytes_in += frame_len
                if existed == 0:
                    with self._lock:
                        self.net_bytes += frame_len
            else:
                counters.dropped_writes += 1
                failed.append((name, parts, next(r for r in sets if r is not True)))
        if failed:
            self._clean_up(failed)
        return stored

    def _clean_up(self, failed: list[tuple[str, list[str], object]]) -> None:
        """Delete the parts a refused write left behind (e.g. the server is out of
        memory: DEL is still allowed)."""
        name, _, reply = failed[0]
        self.faults.fault("put", RuntimeError(f"{name}: {reply}"),
                          f"dropping {len(failed)} writes")
        orphans = [(parts) for _, parts, _ in failed if parts]
        if not orphans:
            return
        with self.faults.guard("put clean-up", "parts left to expire"):
            pipe = self.connection.pipeline()
            for parts in orphans:
                pipe.execute_command("DEL", *parts)
            self.connection.execute(pipe)
