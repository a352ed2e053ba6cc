"""Reads of the redis tier: lookups, gets (with parts reassembled) and deletes.

A get never returns wrong KV: a missing part is a miss and the entry is
deleted; a value that is not an lmkv entry, or whose frame fails its
checksum, is counted as corrupt, deleted and a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from lmkv.memory import MemoryObj
from lmkv.tokens import CacheKey
from lmkv_redis.layout import ENVELOPE, MAX_PARTS, BadEnvelope, part_names, read_envelope

if TYPE_CHECKING:
    from lmkv_redis.backend import RedisBackend

logger = logging.getLogger(__name__)

_PROBE_END = ENVELOPE.size - 1
_DELETE_IF_EMPTY = ("if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('STRLEN', KEYS[1]) "
                    "== 0 then return redis.call('DEL', KEYS[1]) end return 0")


@dataclass
class _Fetched:
    key: CacheKey
    name: str
    values: list[Any]  # main value, then the parts fetched so far
    parts: list[str] = field(default_factory=list)  # names of parts 1..n-1
    frame_len: int = 0


class Reader:
    def __init__(self, backend: RedisBackend) -> None:
        self.backend = backend
        self.options = backend.options
        self.last_frame_len = 0  # sizes the windows of a get (chunks are alike)

    # -- lookups ------------------------------------------------------------------
    def probe(self, names: Sequence[str]) -> list[int]:
        """Part count of each entry (0: absent), in one pipeline.

        ``GETRANGE 0 15`` reads the envelope without moving the value; an
        empty reply means no such key.
        """
        pipe = self.backend.client().pipeline(transaction=False)
        for name in names:
            pipe.execute_command("GETRANGE", name, 0, _PROBE_END)
        replies = pipe.execute(raise_on_error=False)
        counts = [_part_count(reply) for reply in replies]
        first_miss = next((i for i, c in enumerate(counts) if c == 0), None)
        if first_miss is not None:
            # GETRANGE answers "" for an absent key and for an empty value alike:
            # the lookup takes it as a miss now, and a check in the background
            # removes an empty value (a corrupt frame) without costing the lookup.
            self.backend.sweep_empty(names[first_miss])
        return counts

    # -- gets -------------------------------------------------------------------------
    def get_prefix(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        """The leading entries found, decoded, in windows of ``pipeline_bytes``."""
        out: list[MemoryObj] = []
        start = 0
        while start < len(keys):
            window = max(1, self.options.pipeline_bytes // self.last_frame_len
                         ) if self.last_frame_len else len(keys)
            batch = keys[start:start + window]
            try:
                found = self._get_window(batch)
            except BaseException:
                _release(out)
                raise
            out.extend(found)
            if len(found) < len(batch):
                break
            start += len(batch)
        return out

    def _get_window(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        backend = self.backend
        prefix = self.options.key_prefix
        entries = []
        pipe = backend.client().pipeline(transaction=False)
        for key in keys:
            name = backend.main_key(key)
            guessed = part_names(prefix, name, backend.part_hint(name))
            entries.append(_Fetched(key, name, []))
            if guessed:  # the lookup saw parts: fetch them all now (one slot, one MGET)
                pipe.execute_command("MGET", name, *guessed)
            else:  # GET, not MGET: a key of another type answers WRONGTYPE, not nil
                pipe.execute_command("GET", name)
        for entry, reply in zip(entries, pipe.execute(raise_on_error=False), strict=True):
            entry.values = reply if isinstance(reply, list) else [reply]

        usable = self._check_mains(entries)
        self._fetch_missing_parts(usable)
        out: list[MemoryObj] = []
        try:
            for entry in usable:
                frame = self._assemble(entry)
                obj = backend.decode_frame(entry.key, frame) if frame is not None else None
                if obj is None:
                    break
                backend.counters.bytes_out += entry.frame_len
                out.append(obj)
        except BaseException:  # a delete that failed mid-window: give the buffers back
            _release(out)
            raise
        return out

    def _check_mains(self, entries: list[_Fetched]) -> list[_Fetched]:
        """The leading entries whose main value is present and well formed."""
        usable = []
        for entry in entries:
            main = entry.values[0]
            if isinstance(main, redis.ResponseError):  # e.g. WRONGTYPE: not ours
                self._drop_corrupt(entry, f"reply {main}")
                break
            if main is None:
                break
            try:
                env = read_envelope(main)
            except BadEnvelope as exc:
                self._drop_corrupt(entry, str(exc))
                break
            if env is None:
                entry.frame_len = len(main)
            else:
                entry.frame_len = env.frame_len
                entry.parts = part_names(self.options.key_prefix, entry.name, env.count)
                if len(entry.parts) != env.count - 1:
                    self._drop_corrupt(entry, "parts under a key that cannot have any")
                    break
            usable.append(entry)
        return usable

    def _fetch_missing_parts(self, entries: list[_Fetched]) -> None:
        """Parts the first pipeline did not guess (no pin told their count): one more."""
        short = [e for e in entries if len(e.values) - 1 < len(e.parts)]
        if not short:
            return
        pipe = self.backend.client().pipeline(transaction=False)
        for entry in short:
            pipe.execute_command("MGET", *entry.parts[len(entry.values) - 1:])
        for entry, reply in zip(short, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, list):
                entry.values.extend(reply)
            else:
                entry.values.extend([None] * (len(entry.parts) + 1 - len(entry.values)))

    def _assemble(self, entry: _Fetched) -> Any:
        """The entry's frame, or None (counted, and the entry deleted) when a part
        is missing or does not fit."""
        main = entry.values[0]
        self.last_frame_len = entry.frame_len
        if not entry.parts:
            return main
        values = entry.values[:len(entry.parts) + 1]
        if any(v is None or isinstance(v, Exception) for v in values):
            self.backend.faults.note("missing-part", "entry %s lost a part (expired or "
                                     "evicted); a miss, deleting the rest", entry.name)
            self.backend.counters.misses += 1
            self._delete_quietly(entry.name)
            return None
        frame = np.empty(entry.frame_len, dtype=np.uint8)
        offset = 0
        for value in [memoryview(main)[ENVELOPE.size:], *values[1:]]:
            end = offset + len(value)
            if end > entry.frame_len:
                break
            frame[offset:end] = np.frombuffer(value, dtype=np.uint8)
            offset = end
        if offset != entry.frame_len:
            self._drop_corrupt(entry, "parts do not add up to the frame length")
            return None
        return memoryview(frame)

    def _drop_corrupt(self, entry: _Fetched, reason: str) -> None:
        self.backend.counters.corrupt_frames += 1
        self.backend.counters.misses += 1
        self.backend.faults.note("corrupt", "dropping corrupt entry %s: %s", entry.name, reason)
        self._delete_quietly(entry.name)

    def _delete_quietly(self, name: str) -> None:
        try:
            self.delete(name)
        except Exception as exc:  # the get still answers its miss
            if not self.backend.faults.expected(exc):
                raise
            self.backend.faults.record("delete", exc, "entry left in place")

    def drop_if_empty(self, name: str) -> bool:
        """Delete ``name`` when it holds an empty string (no frame is that short);
        True when it did (counted as a corrupt frame)."""
        # One script: a writer's fresh frame between the check and the delete must
        # never be deleted.
        if not self.backend.client().execute_command("EVAL", _DELETE_IF_EMPTY, 1, name):
            return False
        self.backend.counters.corrupt_frames += 1
        self.backend.faults.note("corrupt", "dropping corrupt entry %s: an empty value", name)
        return True

    # -- deletes ----------------------------------------------------------------------
    def delete(self, name: str) -> bool:
        """Delete the entry under ``name`` and all its parts; False when absent."""
        client = self.backend.client()
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("GETRANGE", name, 0, _PROBE_END)
        pipe.execute_command("STRLEN", name)
        head, length = pipe.execute(raise_on_error=False)
        count = _part_count(head)
        size = length if isinstance(length, int) else 0
        if isinstance(head, (bytes, bytearray, memoryview)) and count > 1:
            size = ENVELOPE.unpack_from(head, 0)[2]
        names = [name, *part_names(self.options.key_prefix, name, min(count, MAX_PARTS))]
        removed = client.execute_command("DEL", *names)
        if removed:
            self.backend._writer.forget(size)
        return bool(removed)


def _part_count(head: Any) -> int:
    """Parts of an entry from the first bytes of its main value (0: absent)."""
    if isinstance(head, Exception):
        return 1  # some other type under our key: present; a get will clean it up
    if not head:
        return 0
    if bytes(head[:4]) == b"LMKR" and len(head) >= ENVELOPE.size:
        return max(1, min(ENVELOPE.unpack_from(head, 0)[1], MAX_PARTS))
    return 1


def _release(objs: list[MemoryObj]) -> None:
    for obj in objs:
        obj.ref_down()
