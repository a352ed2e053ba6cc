"""The ``naive`` serializer: the raw bytes of the chunk behind lmkv's frame header."""

from __future__ import annotations

import numpy as np

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.serde import Serializer
from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryObj, nbytes_of


class NaiveSerializer(Serializer):
    name = "naive"
    api_version = "2.0"
    serializer_id = 1
    raw_payload = True

    def serialize(self, obj: MemoryObj, key: CacheKey) -> list[bytes | memoryview]:
        return self.framed(obj, obj.byte_view().numpy().data, key)

    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate, key: CacheKey) -> MemoryObj | None:
        header, payload = self.open_frame(frame, key)
        if header.payload_len != nbytes_of(header.shape, header.dtype):
            raise CorruptFrameError("payload length does not match dtype and shape")
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        obj.byte_view().numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        return obj
