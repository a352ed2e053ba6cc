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


#: Why a direct read stopped.
FOUND, ABSENT, OTHER_LAYOUT = "found", "absent", "other"


@dataclass
class Fetched:
    """One window on its way: fresh arena buffers the store has filled (or
    ``codes`` None: no room or unregistered memory, nothing was asked)."""

    keys: Sequence[CacheKey]
    objs: list[MemoryObj | None]
    header_block: MemoryObj | None
    codes: list[int] | None

    def release(self) -> None:
        """Give back every buffer not handed over (idempotent)."""
        objs, self.objs = self.objs, []
        for obj in objs:
            if obj is not None:
                obj.ref_down()
        if self.header_block is not None:
            self.header_block.ref_down()
            self.header_block = None


def fetch(store: Any, names: Sequence[str], keys: Sequence[CacheKey], layout: Layout,
          allocate: Allocate, staging: MemoryAllocator, registered: Registered,
          register_arena: bool) -> Fetched:
    """Allocate ``keys``' buffers and have the store scatter their frames into
    them (one ``batch_get_into_multi_buffers``); nothing is checked yet."""
    fetched = Fetched(keys, [], staging.allocate((layout.header_len * len(keys),), torch.uint8),
                      None)
    try:
        for _ in keys:
            obj = allocate(layout.shape, layout.dtype)
            if obj is None:
                return fetched  # no room: the staged way sorts it out
            fetched.objs.append(obj)
        if fetched.header_block is None:
            return fetched
        arena = fetched.objs[0].allocator
        if arena is not None and register_arena:
            registered.register(store, arena.arena.data_ptr(), arena.arena.numel())
        if not all(registered.covers(o.tensor.data_ptr(), layout.payload_len)
                   for o in fetched.objs):
            return fetched
        base = fetched.header_block.tensor.data_ptr()
        hlen, plen = layout.header_len, layout.payload_len
        fetched.codes = store.batch_get_into_multi_buffers(
            list(names), [[base + i * hlen, o.tensor.data_ptr()]
                          for i, o in enumerate(fetched.objs)],
            [[hlen, plen]] * len(fetched.objs))
        return fetched
    except BaseException:
        fetched.release()
        raise


def settle(fetched: Fetched, layout: Layout, drop_corrupt: Callable[[CacheKey, object], None],
           out: list[MemoryObj]) -> tuple[int, str]:
    """Check each fetched frame (header bound to its key and of the guessed
    layout, payload checksum) and append the good leading ones to ``out``;
    returns how many and why it stopped (FOUND: all). Releases the rest."""
    try:
        if fetched.codes is None:
            return 0, OTHER_LAYOUT
        hlen, plen = layout.header_len, layout.payload_len
        headers = fetched.header_block.tensor.numpy()
        taken = 0
        for i, (key, code) in enumerate(zip(fetched.keys, fetched.codes, strict=True)):
            if code == OBJECT_NOT_FOUND:
                return taken, ABSENT
            if code != hlen + plen:
                return taken, OTHER_LAYOUT  # another size (or a failure the staged way reports)
            obj = fetched.objs[i]
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
            fetched.objs[i] = None  # handed over
            taken += 1
        return taken, FOUND
    finally:
        fetched.release()
