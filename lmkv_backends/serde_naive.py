"""The ``naive`` serializer: the raw bytes of the chunk behind lmkv's frame header."""

from __future__ import annotations

import numpy as np

from lmkv.backend import Allocate
from lmkv.errors import CorruptFrameError
from lmkv.memory import MemoryObj, nbytes_of
from lmkv.serde import Serializer, read_header, verify_payload, write_header


class NaiveSerializer(Serializer):
    name = "naive"
    serializer_id = 1
    raw_payload = True

    def serialize(self, obj: MemoryObj) -> list[bytes | memoryview]:
        payload = memoryview(obj.byte_view().numpy())
        header = write_header(self.serializer_id, obj.dtype, tuple(obj.shape), payload,
                              len(payload))
        return [header, payload]

    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate) -> MemoryObj | None:
        view = memoryview(frame).cast("B")
        header = read_header(view)
        if header.serializer_id != self.serializer_id:
            raise CorruptFrameError(
                f"frame was written by serializer id {header.serializer_id}, "
                f"not {self.name} ({self.serializer_id})")
        if header.payload_len != nbytes_of(header.shape, header.dtype):
            raise CorruptFrameError("payload length does not match dtype and shape")
        payload = view[header.header_len:]
        verify_payload(header, payload)
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        obj.byte_view().numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        return obj
