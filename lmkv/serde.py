"""The Serializer ABC and the frame header every serializer shares.

A frame is ``header | payload``. The header carries magic, format version,
serializer id, dtype, shape, payload length and an xxh3-64 checksum of the
payload, plus a checksum of the header itself. ``read_header`` and
``verify_payload`` raise CorruptFrameError on anything off; the storage layer
turns that into a miss and drops the entry.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from lmkv.backend import Allocate
from lmkv.errors import CorruptFrameError
from lmkv.memory import MemoryObj
from lmkv.plugins.base import Plugin

MAGIC = b"LMKV"
FORMAT_VERSION = 1

# Stable on-disk codes: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.int8: 5, torch.uint8: 6, torch.int32: 7, torch.int64: 8,
    torch.float8_e4m3fn: 9, torch.float8_e5m2: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

# magic, version, serializer id, dtype code, ndim, payload length, payload checksum
_FIXED = struct.Struct("<4sBBBBQQ")
_DIM = struct.Struct("<Q")
_HEADER_SUM = struct.Struct("<Q")
MAX_NDIM = 8


@dataclass(frozen=True)
class FrameHeader:
    serializer_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    header_len: int


def payload_checksum(payload: object) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(serializer_id: int, dtype: torch.dtype, shape: Sequence[int],
                 payload: object, payload_len: int) -> bytes:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} cannot be framed")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, serializer_id, DTYPE_CODES[dtype], len(shape),
                       payload_len, payload_checksum(payload))
    body += b"".join(_DIM.pack(d) for d in shape)
    return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))


def read_header(frame: memoryview) -> FrameHeader:
    """Parse and check the header of ``frame`` (not the payload)."""
    if len(frame) < _FIXED.size + _HEADER_SUM.size:
        raise CorruptFrameError(f"frame of {len(frame)} bytes is shorter than a header")
    magic, version, sid, dcode, ndim, plen, checksum = _FIXED.unpack_from(frame, 0)
    if magic != MAGIC:
        raise CorruptFrameError("not an lmkv frame (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptFrameError(f"unsupported frame version {version}")
    if ndim > MAX_NDIM:
        raise CorruptFrameError(f"frame claims {ndim} dimensions")
    body_len = _FIXED.size + ndim * _DIM.size
    header_len = body_len + _HEADER_SUM.size
    if len(frame) < header_len:
        raise CorruptFrameError("truncated frame header")
    (expected,) = _HEADER_SUM.unpack_from(frame, body_len)
    if xxhash.xxh3_64_intdigest(frame[:body_len]) != expected:
        raise CorruptFrameError("frame header checksum mismatch")
    if dcode not in CODE_DTYPES:
        raise CorruptFrameError(f"unknown dtype code {dcode}")
    shape = tuple(_DIM.unpack_from(frame, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    if len(frame) != header_len + plen:
        raise CorruptFrameError(
            f"frame is {len(frame)} bytes, header says {header_len + plen}")
    return FrameHeader(sid, CODE_DTYPES[dcode], shape, plen, checksum, header_len)


def verify_payload(header: FrameHeader, payload: memoryview) -> None:
    if payload_checksum(payload) != header.checksum:
        raise CorruptFrameError("frame payload checksum mismatch")


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

    def __init__(self, options: object = None) -> None:
        self.options = self.parse_options(options)

    @abstractmethod
    def serialize(self, obj: MemoryObj) -> list[bytes | memoryview]:
        """The frame as a list of buffers to write back to back (no copy needed)."""

    @abstractmethod
    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate) -> MemoryObj | None:
        """Decode ``frame`` into a buffer from ``allocate`` (None: no room).

        Raises CorruptFrameError when the frame fails to decode or verify.
        """

    def frame_bytes(self, obj: MemoryObj) -> bytes:
        return b"".join(self.serialize(obj))

    def framed(self, obj: MemoryObj, payload: bytes | memoryview) -> list[bytes | memoryview]:
        """``[header, payload]`` for ``obj``: what ``serialize`` returns."""
        return [write_header(self.serializer_id, obj.dtype, tuple(obj.shape), payload,
                             len(payload)), payload]

    def open_frame(self, frame: bytes | bytearray | memoryview
                   ) -> tuple[FrameHeader, memoryview]:
        """Check a frame's header, serializer id and payload checksum; returns the
        header and the payload. Raises CorruptFrameError on anything off."""
        view = memoryview(frame).cast("B")
        header = read_header(view)
        if header.serializer_id != self.serializer_id:
            raise CorruptFrameError(
                f"frame was written by serializer id {header.serializer_id}, "
                f"not {self.name} ({self.serializer_id})")
        payload = view[header.header_len:]
        verify_payload(header, payload)
        return header, payload
