"""``zstd``: lossless compression of chunk frames.

KV values compress poorly as raw bytes, but their high bytes (sign and
exponent) are highly repetitive. With ``shuffle`` (default) the payload is
split into byte planes (all first bytes, then all second bytes, ...) before
compression, which is what makes zstd worth its CPU time on KV.
"""

from __future__ import annotations

import struct
from typing import Annotated

import numpy as np
import zstandard
from pydantic import Field

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.plugin import PluginOptions
from lmkv.contracts.serde import Serializer
from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryObj, nbytes_of

_SHUFFLED = 1


class ZstdOptions(PluginOptions):
    level: Annotated[int, Field(ge=-7, le=22)] = 1
    """zstd level: negative is faster, 22 is smallest."""
    shuffle: bool = True
    """Split values into byte planes before compressing (better ratio on KV)."""
    threads: Annotated[int, Field(ge=0, le=64)] = 0
    """Compression threads (0: compress on the calling thread)."""


_PLANE = struct.Struct("<BQ")  # mode (0 raw, 1 zstd), stored length
_RAW, _ZSTD = 0, 1
# A byte plane that zstd shrinks by less than this is stored raw: mantissa bytes
# are close to random, and compressing them only costs time.
_WORTH_IT = 0.9


class ZstdSerializer(Serializer):
    name = "zstd"
    api_version = "2.0"
    serializer_id = 2
    Options = ZstdOptions
    options: ZstdOptions

    def serialize(self, obj: MemoryObj, key: CacheKey) -> list[bytes | memoryview]:
        raw = obj.byte_view()
        itemsize = obj.dtype.itemsize
        shuffle = self.options.shuffle and itemsize > 1
        planes = raw.view(-1, itemsize).t().contiguous() if shuffle else raw.view(1, -1)
        # ZstdCompressor objects are not thread-safe: one per call is cheap enough.
        cctx = zstandard.ZstdCompressor(level=self.options.level, threads=self.options.threads)
        parts: list[bytes | memoryview] = [bytes([_SHUFFLED if shuffle else 0])]
        for plane in planes.numpy():
            packed = cctx.compress(plane)
            if len(packed) < _WORTH_IT * len(plane):
                parts += [_PLANE.pack(_ZSTD, len(packed)), packed]
            else:
                parts += [_PLANE.pack(_RAW, len(plane)), memoryview(plane)]
        return self.framed(obj, b"".join(parts), key)

    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate, key: CacheKey) -> MemoryObj | None:
        header, payload = self.open_frame(frame, key)
        if not payload:
            raise CorruptFrameError("empty zstd payload")
        itemsize = header.dtype.itemsize
        shuffled = bool(payload[0] & _SHUFFLED)
        n_planes = itemsize if shuffled and itemsize > 1 else 1
        plane_len = nbytes_of(header.shape, header.dtype) // n_planes
        planes, pos = [], 1
        for _ in range(n_planes):
            if pos + _PLANE.size > len(payload):
                raise CorruptFrameError("truncated zstd payload")
            mode, length = _PLANE.unpack_from(payload, pos)
            pos += _PLANE.size
            data = payload[pos:pos + length]
            pos += length
            planes.append(self._plane(mode, data, plane_len))
        if pos != len(payload):
            raise CorruptFrameError("zstd payload has trailing bytes")
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        target = obj.byte_view().view(-1, n_planes) if shuffled else obj.byte_view().view(1, -1)
        for i, plane in enumerate(planes):
            dst = target[:, i] if shuffled else target[0]
            dst.numpy()[:] = np.frombuffer(plane, dtype=np.uint8)
        return obj

    @staticmethod
    def _plane(mode: int, data: memoryview, plane_len: int) -> bytes | memoryview:
        out: bytes | memoryview
        if mode == _RAW:
            out = data
        elif mode == _ZSTD:
            try:
                out = zstandard.ZstdDecompressor().decompress(data, max_output_size=plane_len)
            except zstandard.ZstdError as exc:
                raise CorruptFrameError(f"zstd plane does not decompress: {exc}") from None
        else:
            raise CorruptFrameError(f"unknown zstd plane mode {mode}")
        if len(out) != plane_len:
            raise CorruptFrameError(f"zstd plane is {len(out)} bytes, {plane_len} expected")
        return out
