"""Reads of the redis tier: lookups, gets (with parts reassembled) and deletes.

The reader fetches and reassembles frames; it decides nothing about faults.
Each fetched entry comes back as a frame, as corrupt (a value that is not an
lmkv entry, parts that do not add up) or as having lost a part; the backend
decodes the frames and applies the tier's fault policy to the rest (a miss,
the entry deleted, a corrupt one counted). Errors of Redis itself raise to
the backend. The reader holds the connection, never the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from lmkv.contracts import CacheKey
from lmkv_redis.connection import Connection
from lmkv_redis.layout import ENVELOPE, MAX_PARTS, BadEnvelope, part_names, read_envelope

logger = logging.getLogger(__name__)

_PROBE_END = ENVELOPE.size - 1
_DELETE_IF_EMPTY = ("if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('STRLEN', KEYS[1]) "
                    "== 0 then return redis.call('DEL', KEYS[1]) end return 0")


@dataclass
class Fetched:
    """One entry a get fetched: ``frame`` when whole, else ``corrupt`` (why) or
    ``lost_part`` (a part expired or was evicted: a miss, not corruption)."""

    key: CacheKey
    name: str
    values: list[Any]  # main value, then the parts fetched so far
    parts: list[str] = field(default_factory=list)  # names of parts 1..n-1
    frame_len: int = 0
    frame: Any = None
    corrupt: str | None = None
    lost_part: bool = False


class Reader:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.options = connection.options
        self.last_frame_len = 0  # sizes the windows of a get (chunks are alike)

    # -- lookups ------------------------------------------------------------------
    def probe(self, names: Sequence[str]) -> list[int]:
        """Part count of each entry (0: absent, or an empty value), in one pipeline.

        ``GETRANGE 0 15`` reads the envelope without moving the value; an
        empty reply means no such key.
        """
        pipe = self.connection.pipeline()
        for name in names:
            pipe.execute_command("GETRANGE", name, 0, _PROBE_END)
        return [_part_count(reply) for reply in self.connection.execute(pipe)]

    # -- gets -------------------------------------------------------------------------
    def fetch(self, keys: Sequence[CacheKey], part_hint: Callable[[str], int]
              ) -> list[Fetched]:
        """One window of a get, in one pipeline (two when a part count was not
        known): the leading entries present, the last of them possibly not a
        frame. ``part_hint(name)``: the part count a lookup saw."""
        prefix = self.options.key_prefix
        entries = []
        pipe = self.connection.pipeline()
        for key in keys:
            name = self.connection.main_key(key)
            guessed = part_names(prefix, name, part_hint(name))
            entries.append(Fetched(key, name, []))
            if guessed:  # the lookup saw parts: fetch them all now (one slot, one MGET)
                pipe.execute_command("MGET", name, *guessed)
            else:  # GET, not MGET: a key of another type answers WRONGTYPE, not nil
                pipe.execute_command("GET", name)
        for entry, reply in zip(entries, self.connection.execute(pipe), strict=True):
            entry.values = reply if isinstance(reply, list) else [reply]

        usable = self._check_mains(entries)
        self._fetch_missing_parts([e for e in usable if e.corrupt is None])
        for i, entry in enumerate(usable):
            if entry.corrupt is None:
                self._assemble(entry)
            if entry.frame is None:
                return usable[:i + 1]
        return usable

    def _check_mains(self, entries: list[Fetched]) -> list[Fetched]:
        """The leading entries present; the last may be corrupt (main value not
        well formed)."""
        usable = []
        for entry in entries:
            main = entry.values[0]
            if isinstance(main, redis.ResponseError):  # e.g. WRONGTYPE: not ours
                entry.corrupt = f"reply {main}"
                usable.append(entry)
                break
            if main is None:
                break
            try:
                env = read_envelope(main)
            except BadEnvelope as exc:
                entry.corrupt = str(exc)
                usable.append(entry)
                break
            if env is None:
                entry.frame_len = len(main)
            else:
                entry.frame_len = env.frame_len
                entry.parts = part_names(self.options.key_prefix, entry.name, env.count)
                if len(entry.parts) != env.count - 1:
                    entry.corrupt = "parts under a key that cannot have any"
                    usable.append(entry)
                    break
            usable.append(entry)
        return usable

    def _fetch_missing_parts(self, entries: list[Fetched]) -> None:
        """Parts the first pipeline did not guess (no pin told their count): one more."""
        short = [e for e in entries if len(e.values) - 1 < len(e.parts)]
        if not short:
            return
        pipe = self.connection.pipeline()
        for entry in short:
            pipe.execute_command("MGET", *entry.parts[len(entry.values) - 1:])
        for entry, reply in zip(short, self.connection.execute(pipe), strict=True):
            if isinstance(reply, list):
                entry.values.extend(reply)
            else:
                entry.values.extend([None] * (len(entry.parts) + 1 - len(entry.values)))

    def _assemble(self, entry: Fetched) -> None:
        """Set the entry's frame; or ``lost_part`` when a part is missing, or
        ``corrupt`` when the parts do not add up."""
        main = entry.values[0]
        self.last_frame_len = entry.frame_len
        if not entry.parts:
            entry.frame = main
            return
        values = entry.values[:len(entry.parts) + 1]
        if any(v is None or isinstance(v, Exception) for v in values):
            entry.lost_part = True
            return
        frame = np.empty(entry.frame_len, dtype=np.uint8)
        offset = 0
        for value in [memoryview(main)[ENVELOPE.size:], *values[1:]]:
            end = offset + len(value)
            if end > entry.frame_len:
                break
            frame[offset:end] = np.frombuffer(value, dtype=np.uint8)
            offset = end
        if offset != entry.frame_len:
            entry.corrupt = "parts do not add up to the frame length"
            return
        entry.frame = frame.data

    def drop_if_empty(self, name: str) -> bool:
        """Delete ``name`` when it holds an empty string (no frame is that short);
        True when it did."""
        # One script: a writer's fresh frame between the check and the delete must
        # never be deleted.
        return bool(self.connection.command("EVAL", _DELETE_IF_EMPTY, 1, name))

    # -- deletes ----------------------------------------------------------------------
    def delete(self, name: str) -> int | None:
        """Delete the entry under ``name`` and all its parts: the frame bytes it
        held, or None when it was absent."""
        pipe = self.connection.pipeline()
        pipe.execute_command("GETRANGE", name, 0, _PROBE_END)
        pipe.execute_command("STRLEN", name)
        head, length = self.connection.execute(pipe)
        count = _part_count(head)
        size = length if isinstance(length, int) else 0
        if isinstance(head, (bytes, bytearray, memoryview)) and count > 1:
            size = ENVELOPE.unpack_from(head, 0)[2]
        names = [name, *part_names(self.options.key_prefix, name, min(count, MAX_PARTS))]
        return size if self.connection.command("DEL", *names) else None


def _part_count(head: Any) -> int:
    """Parts of an entry from the first bytes of its main value (0: absent)."""
    if isinstance(head, Exception):
        return 1  # some other type under our key: present; a get will clean it up
    if not head:
        return 0
    if bytes(head[:4]) == b"LMKR" and len(head) >= ENVELOPE.size:
        return max(1, min(ENVELOPE.unpack_from(head, 0)[1], MAX_PARTS))
    return 1

