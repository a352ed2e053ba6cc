"""How one lmkv entry lies in Redis: key names, parts and the parts envelope.

An entry is a frame from lmkv's serializer. Its main key is
``key_prefix + key.to_string()``.

* A frame of at most ``part_bytes`` is the main key's value, as is.
* A larger frame is cut into ``n`` parts of ``part_bytes`` (the last one
  shorter). The main key holds a 16-byte envelope (``LMKR``, ``n``, the
  frame's length) followed by part 0; parts 1..n-1 live under
  ``key_prefix + "{" + main key + "}#" + i``. The hash tag ``{main key}``
  puts every part in the main key's cluster slot, so one ``MGET`` fetches
  them all, and every key still starts with ``key_prefix``.

An lmkv frame starts with ``LMKV``, so the two kinds never mix up; anything
else under an lmkv key is a corrupt entry (a miss, then removed).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

ENVELOPE = struct.Struct("<4sIQ")
ENVELOPE_MAGIC = b"LMKR"
#: The most parts an entry may have (a bound on what a corrupt envelope can claim).
MAX_PARTS = 1 << 16


def hash_tag(name: str) -> str | None:
    """The part of ``name`` Redis Cluster hashes when it is not the whole name."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None
    return name[start + 1:end]


def part_names(prefix: str, main: str, count: int) -> list[str]:
    """Names of parts 1..count-1 of the entry under ``main``, all in its hash slot.

    Empty when the main name makes that impossible (a ``}`` without a valid
    hash tag, only from a model name with braces): such entries are never split.
    """
    if count <= 1:
        return []
    if hash_tag(main) is not None:  # the main key already names its slot; keep that tag
        return [f"{main}#{i}" for i in range(1, count)]
    if "}" in main:
        return []
    return [f"{prefix}{{{main}}}#{i}" for i in range(1, count)]


def split(buffers: Sequence[bytes | memoryview], part_bytes: int
          ) -> list[list[memoryview]]:
    """Cut the concatenation of ``buffers`` into parts of ``part_bytes`` (views, no copy)."""
    parts: list[list[memoryview]] = [[]]
    room = part_bytes
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            if room == 0:
                parts.append([])
                room = part_bytes
            take = view[:room]
            parts[-1].append(take)
            room -= len(take)
            view = view[len(take):]
    return parts


def envelope(count: int, frame_len: int) -> bytes:
    return ENVELOPE.pack(ENVELOPE_MAGIC, count, frame_len)


class BadEnvelope(ValueError):
    """The main value claims parts in a way no writer produces."""


@dataclass(frozen=True)
class Envelope:
    count: int  # parts, including part 0 in the main value
    frame_len: int
    part_len: int  # length of part 0 (every part but the last has this length)


def read_envelope(main_value: memoryview | bytes) -> Envelope | None:
    """The envelope at the start of a main value; None when it holds a whole frame."""
    if bytes(main_value[:4]) != ENVELOPE_MAGIC:
        return None
    if len(main_value) <= ENVELOPE.size:
        raise BadEnvelope("parts envelope without part 0")
    _, count, frame_len = ENVELOPE.unpack_from(main_value, 0)
    part_len = len(main_value) - ENVELOPE.size
    if not 2 <= count <= MAX_PARTS or -(-frame_len // part_len) != count:
        raise BadEnvelope(f"envelope claims {count} parts of a {frame_len}-byte frame "
                          f"with part 0 of {part_len} bytes")
    return Envelope(count, frame_len, part_len)
