from __future__ import annotations

import pytest
import torch

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.serde import DTYPE_CODES, write_header
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MAX_CHUNK_NDIM, MemoryAllocator, tensor_obj
from lmkv_backends.serde.naive import NaiveSerializer

KEY = CacheKey(KeyMeta("m", geometry="2x2x4"), b"\x07" * 32)


@pytest.fixture
def alloc() -> MemoryAllocator:
    return MemoryAllocator(1 << 20)


def frame_of(tensor: torch.Tensor) -> bytes:
    return NaiveSerializer().frame_bytes(tensor_obj(tensor), KEY)


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_round_trip_every_dtype(dtype: torch.dtype, alloc: MemoryAllocator) -> None:
    data = (torch.randn(2, 2, 8, 2, 4) * 10).to(dtype)
    obj = NaiveSerializer().deserialize(frame_of(data), alloc.allocate, KEY)
    assert obj.dtype == dtype and obj.shape == data.shape
    assert torch.equal(obj.tensor.view(torch.uint8), data.view(torch.uint8))
    obj.ref_down()


def test_no_room_is_none(alloc: MemoryAllocator) -> None:
    frame = frame_of(torch.ones(4))
    assert NaiveSerializer().deserialize(frame, lambda shape, dtype: None, KEY) is None


def corruptions(frame: bytes) -> dict[str, bytes]:
    flip = lambda i: frame[:i] + bytes([frame[i] ^ 0x10]) + frame[i + 1:]  # noqa: E731
    return {
        "payload bit flip": flip(len(frame) - 3),
        "header bit flip": flip(10),
        "shape bit flip": flip(44),
        "key digest bit flip": flip(30),
        "truncated payload": frame[:-1],
        "truncated header": frame[:12],
        "extra bytes": frame + b"\0",
        "empty": b"",
        "foreign value": b"hello world, not a frame at all" * 4,
        "bad magic": b"XXXX" + frame[4:],
    }


@pytest.mark.parametrize("case", list(corruptions(b"\0" * 300)))
def test_corrupted_frames_raise(case: str, alloc: MemoryAllocator) -> None:
    frame = frame_of(torch.randn(2, 2, 8, 2, 4).half())
    with pytest.raises(CorruptFrameError):
        NaiveSerializer().deserialize(corruptions(frame)[case], alloc.allocate, KEY)
    assert alloc.live_objects == 0  # nothing allocated for a bad frame


def test_frame_of_another_serializer_is_rejected(alloc: MemoryAllocator) -> None:
    class Other(NaiveSerializer):
        name = "other"
        serializer_id = 200

    frame = Other().frame_bytes(tensor_obj(torch.ones(4)), KEY)
    with pytest.raises(CorruptFrameError, match="serializer id 200"):
        NaiveSerializer().deserialize(frame, alloc.allocate, KEY)


@pytest.mark.parametrize("other", [
    CacheKey(KeyMeta("m", geometry="2x2x4"), b"\x08" * 32),  # another chunk
    CacheKey(KeyMeta("m", geometry="2x2x4"), b"\x07" * 32, layer=0),  # a layer of it
    CacheKey(KeyMeta("m", geometry="4x2x4"), b"\x07" * 32),  # another geometry
    CacheKey(KeyMeta("m", 2, 1, geometry="2x2x4"), b"\x07" * 32),  # another rank
])
def test_a_frame_read_under_another_key_is_corrupt(other: CacheKey,
                                                   alloc: MemoryAllocator) -> None:
    """A valid frame copied, renamed or swapped to another key is never that key's KV."""
    frame = frame_of(torch.randn(2, 2, 8, 2, 4))
    with pytest.raises(CorruptFrameError, match="another key"):
        NaiveSerializer().deserialize(frame, alloc.allocate, other)
    assert alloc.live_objects == 0


def crafted(shape: list[int], dtype: torch.dtype = torch.float16, payload: bytes = b"") -> bytes:
    """A frame whose header checksums are right but whose shape is absurd."""
    return write_header(1, dtype, shape, payload, len(payload), KEY) + payload


@pytest.mark.parametrize("shape", [
    [2**40, 2**40, 0], [0], [4, 0, 4], [2**63, 2], [2**33, 2**33], [1] * (MAX_CHUNK_NDIM + 1), [],
])
def test_crafted_shapes_are_corrupt_and_allocate_nothing(shape: list[int],
                                                         alloc: MemoryAllocator) -> None:
    calls = []

    def allocate(shape, dtype):  # must never be asked for an absurd shape
        calls.append(shape)
        return alloc.allocate(shape, dtype)

    with pytest.raises(CorruptFrameError):
        NaiveSerializer().deserialize(crafted(shape), allocate, KEY)
    assert calls == [] and alloc.live_objects == 0
