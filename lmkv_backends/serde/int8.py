"""``int8``: a lossy quantizer that halves bf16/fp16 KV (quarters fp32).

Buffers that are not floating-point (aliases: ``lmkv.keys.aliases``) are stored
exactly, as their bytes.

Each value becomes ``round(x / scale)`` in int8 with a symmetric absmax
scale per token (``granularity: token``: one scale per layer, K/V, token and
head, over head_dim) or per channel (``granularity: channel``: one scale per
layer, K/V, head and channel, over the chunk's tokens). Scales are stored as
float32. The measured error on real KV is in docs/serializers.md.
"""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
import torch

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.plugin import PluginOptions
from lmkv.contracts.serde import FrameHeader, Serializer
from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryObj

_GRANULARITY = {"token": 1, "channel": 2}
_RAW = 0  # a buffer that is not floating-point KV (an alias, say): its bytes as they are
_PREFIX = struct.Struct("<B")


class Int8Options(PluginOptions):
    granularity: Literal["token", "channel"] = "token"
    """``token``: a scale per token and head (over head_dim); ``channel``: a scale per
    head and channel (over the chunk's tokens)."""


def _reduce_dim(granularity: int) -> int:
    # chunks are [layers, 2, tokens, heads, head_dim] or, heads outer, [layers,
    # heads, tokens, 2, head_dim]: head_dim last and tokens at 2 in both
    return -1 if granularity == _GRANULARITY["token"] else 2


class Int8Serializer(Serializer):
    name = "int8"
    api_version = "2.0"
    serializer_id = 3
    Options = Int8Options
    options: Int8Options

    def serialize(self, obj: MemoryObj, key: CacheKey) -> list[bytes | memoryview]:
        if not obj.tensor.is_floating_point():  # quantizing would change it: kept exact
            return self.framed(obj, b"".join([_PREFIX.pack(_RAW),
                                              obj.byte_view().numpy().tobytes()]), key)
        if obj.tensor.dim() != 5:
            raise ValueError("int8 quantizes chunk buffers [layers, 2, tokens, heads, head_dim] "
                             "(or heads outer: [layers, heads, tokens, 2, head_dim])")
        granularity = _GRANULARITY[self.options.granularity]
        x = obj.tensor.float()
        scale = x.abs().amax(dim=_reduce_dim(granularity), keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return self.framed(obj, b"".join([_PREFIX.pack(granularity), scale.numpy().tobytes(),
                                          q.numpy().tobytes()]), key)

    def deserialize(self, frame: bytes | bytearray | memoryview,
                    allocate: Allocate, key: CacheKey) -> MemoryObj | None:
        header, payload = self.open_frame(frame, key)
        if payload[:1] == _PREFIX.pack(_RAW) and not header.dtype.is_floating_point:
            return self._raw(header, payload[1:], allocate)
        if len(header.shape) != 5:
            raise CorruptFrameError("int8 frame of a non-chunk shape")
        if not payload or payload[0] not in _GRANULARITY.values():
            raise CorruptFrameError("unknown int8 granularity")
        granularity = payload[0]
        scale_shape = list(header.shape)
        scale_shape[_reduce_dim(granularity)] = 1
        n_scale = int(np.prod(scale_shape))
        n_values = int(np.prod(header.shape))
        if len(payload) != 1 + 4 * n_scale + n_values:
            raise CorruptFrameError("int8 payload length does not match its shape")
        scale = torch.from_numpy(np.frombuffer(payload, np.float32, n_scale, 1).copy())
        q = torch.from_numpy(np.frombuffer(payload, np.int8, n_values, 1 + 4 * n_scale).copy())
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        values = q.view(header.shape).float() * scale.view(scale_shape)
        obj.tensor.copy_(values.to(header.dtype))
        return obj

    @staticmethod
    def _raw(header: FrameHeader, payload: memoryview, allocate: Allocate) -> MemoryObj | None:
        n = int(np.prod(header.shape)) * header.dtype.itemsize
        if len(payload) != n:
            raise CorruptFrameError("int8 raw payload length does not match its shape")
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        obj.byte_view().copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return obj
