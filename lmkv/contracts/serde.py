"""The Serializer ABC and the frame header every serializer shares.

A frame is ``header | payload``. The header carries magic, format version,
serializer id, dtype, shape, payload length, an xxh3-64 checksum of the
payload and the digest of the key the frame was written under
(``CacheKey.digest``), plus a checksum of the header itself. ``read_header``
and ``verify_payload`` raise CorruptFrameError on anything off, including a
frame read under another key than its own (copied, renamed, swapped) and a
shape no chunk can have; the storage layer turns that into a miss and drops
the entry.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.plugin import OptionsArg, Plugin
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MAX_CHUNK_NDIM, Allocate, MemoryObj, shape_problem

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"LMKV"
FORMAT_VERSION = 2  # 2: the key digest (version-1 frames are not bound: misses)

# Stable on-disk codes: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.int8: 5, torch.uint8: 6, torch.int32: 7, torch.int64: 8,
    torch.float8_e4m3fn: 9, torch.float8_e5m2: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

# magic, version, serializer id, dtype code, ndim, payload length, payload checksum,
# key digest
_FIXED = struct.Struct("<4sBBBBQQ16s")
_DIM = struct.Struct("<Q")
_HEADER_SUM = struct.Struct("<Q")
#: No chunk is larger than this; a header that claims more is corrupt.
MAX_CHUNK_BYTES = 1 << 36


@dataclass(frozen=True)
class FrameHeader:
    serializer_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    header_len: int


def payload_checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def header_len(ndim: int) -> int:
    """Bytes of the header ``write_header`` makes for a chunk of ``ndim`` dimensions
    (a raw-payload frame's payload starts there)."""
    return _FIXED.size + ndim * _DIM.size + _HEADER_SUM.size


def write_header(serializer_id: int, dtype: torch.dtype, shape: Sequence[int],
                 payload: Buffer, payload_len: int, key: CacheKey) -> bytes:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} cannot be framed")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, serializer_id, DTYPE_CODES[dtype], len(shape),
                       payload_len, payload_checksum(payload), key.digest())
    body += b"".join(_DIM.pack(d) for d in shape)
    return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))


def read_header(frame: memoryview, key: CacheKey, frame_len: int | None = None) -> FrameHeader:
    """Parse and check the header of a frame stored under ``key`` (not the payload).

    ``frame`` holds the whole frame, or at least its header when ``frame_len``
    gives the whole frame's length.
    """
    frame_len = len(frame) if frame_len is None else frame_len
    if len(frame) < _FIXED.size + _HEADER_SUM.size:
        raise CorruptFrameError(f"frame of {len(frame)} bytes is shorter than a header")
    magic, version, sid, dcode, ndim, plen, checksum, digest = _FIXED.unpack_from(frame, 0)
    if magic != MAGIC:
        raise CorruptFrameError("not an lmkv frame (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptFrameError(f"unsupported frame version {version}")
    if ndim > MAX_CHUNK_NDIM:
        raise CorruptFrameError(f"frame claims {ndim} dimensions")
    body_len = _FIXED.size + ndim * _DIM.size
    header_len = body_len + _HEADER_SUM.size
    if len(frame) < header_len:
        raise CorruptFrameError("truncated frame header")
    (expected,) = _HEADER_SUM.unpack_from(frame, body_len)
    if xxhash.xxh3_64_intdigest(frame[:body_len]) != expected:
        raise CorruptFrameError("frame header checksum mismatch")
    if digest != key.digest():
        raise CorruptFrameError("frame belongs to another key (copied or moved)")
    if dcode not in CODE_DTYPES:
        raise CorruptFrameError(f"unknown dtype code {dcode}")
    shape = tuple(_DIM.unpack_from(frame, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    problem = shape_problem(shape, CODE_DTYPES[dcode].itemsize, MAX_CHUNK_BYTES)
    if problem is not None:
        raise CorruptFrameError(f"frame claims {problem}")
    if frame_len != header_len + plen:
        raise CorruptFrameError(f"frame is {frame_len} bytes, header says {header_len + plen}")
    return FrameHeader(sid, CODE_DTYPES[dcode], shape, plen, checksum, header_len)


def verify_payload(header: FrameHeader, payload: memoryview) -> None:
    if payload_checksum(payload) != header.checksum:
        raise CorruptFrameError("frame payload checksum mismatch")


@dataclass(frozen=True)
class SerializerContext:
    """What lmkv hands a serializer besides its options (``cls(options, context)``).

    Empty today: a serializer needs nothing but its options. It exists so every
    plugin kind is built the same way, and a field lmkv adds later never changes
    a serializer's constructor.
    """


class Serializer(Plugin, ABC):
    """Turns a chunk buffer into a frame and back.

    ``serializer_id`` is written into every frame, so a frame written by one
    serializer is never decoded by another. Pick an unused number >= 100 for
    third-party serializers.
    """

    serializer_id: int = 0
    #: True when a frame's payload is the chunk's raw bytes (``naive``): a tier may
    #: then read the payload straight into an allocated buffer and check it with
    #: ``verify_payload`` instead of calling ``deserialize``.
    raw_payload: bool = False

    def __init__(self, options: OptionsArg = None,
                 context: SerializerContext | None = None) -> None:
        self.options = self.parse_options(options)
        self.context = SerializerContext() if context is None else context

    @abstractmethod
    def serialize(self, obj: MemoryObj, key: CacheKey) -> list[bytes | memoryview]:
        """The frame of ``obj`` stored under ``key``, as a list of buffers to write
        back to back (no copy needed). Build it with ``framed``."""

    @abstractmethod
    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate, key: CacheKey) -> MemoryObj | None:
        """Decode ``frame``, read under ``key``, into a buffer from ``allocate``
        (None: no room). Open it with ``open_frame``.

        Raises CorruptFrameError when the frame fails to decode or verify, or
        was written under another key.
        """

    def frame_bytes(self, obj: MemoryObj, key: CacheKey) -> bytes:
        return b"".join(self.serialize(obj, key))

    def framed(self, obj: MemoryObj, payload: bytes | memoryview,
               key: CacheKey) -> list[bytes | memoryview]:
        """``[header, payload]`` for ``obj`` under ``key``: what ``serialize`` returns."""
        return [write_header(self.serializer_id, obj.dtype, tuple(obj.shape), payload,
                             len(payload), key), payload]

    def open_frame(self, frame: bytes | bytearray | memoryview, key: CacheKey
                   ) -> tuple[FrameHeader, memoryview]:
        """Check a frame's header (bound to ``key``), serializer id and payload
        checksum; returns the header and the payload. Raises CorruptFrameError on
        anything off."""
        view = memoryview(frame).cast("B")
        header = read_header(view, key)
        if header.serializer_id != self.serializer_id:
            raise CorruptFrameError(
                f"frame was written by serializer id {header.serializer_id}, "
                f"not {self.name} ({self.serializer_id})")
        payload = view[header.header_len:]
        verify_payload(header, payload)
        return header, payload
