"""Gets straight into lmkv's arena, without a staging copy.

A frame of the ``naive`` serializer (``raw_payload``) is a header and the
chunk's raw bytes. Once the tier has seen one frame, it knows the layout the
next ones most likely have (every chunk of a model has the same shape but the
last): it allocates each chunk's buffer from lmkv's (registered) arena and
asks the store to scatter each frame into [header staging, chunk buffer] with
one ``batch_get_into_multi_buffers``. The header is then checked against the
key and the guessed layout and the payload against its checksum, in place.

A frame of another size or shape is not a fault: the read stops there and the
rest goes the staged way (``batch_get_buffer``), which learns the new layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmkv.errors import CorruptFrameError
from lmkv.memory import Allocate, MemoryAllocator, MemoryObj
from lmkv.serde import FrameHeader, read_header, verify_payload
from lmkv.tokens import CacheKey
from lmkv_mooncake.client import OBJECT_NOT_FOUND
from lmkv_mooncake.memory import Registered


@dataclass(frozen=True)
class Layout:
    """What the last frame read looked like."""

    serializer_id: int
    header_len: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload_len: int

    @classmethod
    def of(cls, header: FrameHeader) -> Layout:
        return cls(header.serializer_id, header.header_len, header.shape, header.dtype,
                   header.payload_len)


#: What a direct read of one key came to.
FOUND, ABSENT, OTHER_LAYOUT = "found", "absent", "other"


def read_direct(store: Any, names: Sequence[str], keys: Sequence[CacheKey], layout: Layout,
                allocate: Allocate, staging: MemoryAllocator, registered: Registered,
                register_arena: bool, drop_corrupt: Callable[[CacheKey, object], None],
                out: list[MemoryObj]) -> tuple[int, str]:
    """Read ``keys`` into fresh arena buffers; returns how many were appended to
    ``out`` and why it stopped (FOUND: all of them)."""
    objs: list[MemoryObj] = []
    header_block = staging.allocate((layout.header_len * len(keys),), torch.uint8)
    try:
        for _ in keys:
            obj = allocate(layout.shape, layout.dtype)
            if obj is None:
                break
            objs.append(obj)
        if len(objs) < len(keys) or header_block is None:
            return 0, OTHER_LAYOUT  # no room: the staged way sorts it out
        arena = objs[0].allocator
        if arena is not None and register_arena:
            registered.register(store, arena.arena.data_ptr(), arena.arena.numel())
        if not all(registered.covers(o.tensor.data_ptr(), layout.payload_len) for o in objs):
            return 0, OTHER_LAYOUT
        base = header_block.tensor.data_ptr()
        hlen, plen = layout.header_len, layout.payload_len
        codes = store.batch_get_into_multi_buffers(
            list(names), [[base + i * hlen, o.tensor.data_ptr()] for i, o in enumerate(objs)],
            [[hlen, plen]] * len(objs))
        headers = header_block.tensor.numpy()
        taken = 0
        for i, (key, code) in enumerate(zip(keys, codes, strict=True)):
            if code == OBJECT_NOT_FOUND:
                return taken, ABSENT
            if code != hlen + plen:
                return taken, OTHER_LAYOUT  # another size (or a failure the staged way reports)
            obj = objs[i]
            try:
                header = read_header(memoryview(headers[i * hlen:(i + 1) * hlen]), key,
                                     frame_len=code)
                if Layout.of(header) != layout:
                    return taken, OTHER_LAYOUT
                verify_payload(header, memoryview(obj.byte_view().numpy()))
            except CorruptFrameError as exc:
                drop_corrupt(key, exc)
                return taken, ABSENT
            out.append(obj)
            objs[i] = None  # type: ignore[call-overload]  # handed over
            taken += 1
        return taken, FOUND
    finally:
        for obj in objs:
            if obj is not None:
                obj.ref_down()
        if header_block is not None:
            header_block.ref_down()
