"""StorageBackend.decode: a tier built without a serializer is a bug in how it
was built, never a corrupt frame (which would drop a good entry)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from lmkv.contracts.serde import SerializerContext
from lmkv.contracts.tier import BackendContext, StorageBackend
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, MemoryObj, tensor_obj
from lmkv_backends.serde.naive import NaiveSerializer

KEY = CacheKey(KeyMeta("m", geometry="2x2x4"), b"\x07" * 32)


class FrameTier(StorageBackend):
    """Frames in a dict: just enough of a tier to decode what it holds."""

    name = "frames"

    def __init__(self, context: BackendContext) -> None:
        super().__init__(None, context)
        self.frames: dict[CacheKey, bytes] = {}

    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return key in self.frames

    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        raise NotImplementedError

    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        frame = self.frames.get(key)
        return None if frame is None else self.decode_frame(key, frame)

    def pin(self, key: CacheKey) -> bool:
        return key in self.frames

    def unpin(self, key: CacheKey) -> bool:
        return key in self.frames

    def remove(self, key: CacheKey) -> bool:
        return self.frames.pop(key, None) is not None

    @property
    def usage_bytes(self) -> int:
        return sum(len(f) for f in self.frames.values())


def frame() -> bytes:
    return NaiveSerializer(None, SerializerContext()).frame_bytes(
        tensor_obj(torch.arange(16, dtype=torch.float16).view(2, 2, 1, 2, 2)), KEY)


def test_a_tier_with_a_serializer_decodes_its_frame() -> None:
    arena = MemoryAllocator(1 << 16)
    tier = FrameTier(BackendContext(serializer=NaiveSerializer(), allocate=arena.allocate))
    tier.frames[KEY] = frame()
    obj = tier.get_blocking(KEY)
    assert obj is not None and obj.tensor.flatten().tolist() == list(range(16))
    obj.ref_down()


def test_no_serializer_raises_and_keeps_the_entry() -> None:
    arena = MemoryAllocator(1 << 16)
    tier = FrameTier(BackendContext(serializer=None, allocate=arena.allocate))
    tier.frames[KEY] = frame()
    with pytest.raises(TypeError, match="needs a serializer"):
        tier.get_blocking(KEY)
    assert KEY in tier.frames  # not dropped as corrupt
    assert tier.counters.corrupt_frames == 0
