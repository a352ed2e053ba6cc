from __future__ import annotations

import pytest
import torch

from lmkv.errors import CorruptFrameError
from lmkv.memory import MemoryAllocator, tensor_obj
from lmkv.serde import DTYPE_CODES
from lmkv_backends.serde_naive import NaiveSerializer


@pytest.fixture
def alloc() -> MemoryAllocator:
    return MemoryAllocator(1 << 20)


def frame_of(tensor: torch.Tensor) -> bytes:
    return NaiveSerializer().frame_bytes(tensor_obj(tensor))


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_round_trip_every_dtype(dtype: torch.dtype, alloc: MemoryAllocator) -> None:
    data = (torch.randn(2, 2, 8, 2, 4) * 10).to(dtype)
    obj = NaiveSerializer().deserialize(frame_of(data), alloc.allocate)
    assert obj.dtype == dtype and obj.shape == data.shape
    assert torch.equal(obj.tensor.view(torch.uint8), data.view(torch.uint8))
    obj.ref_down()


def test_no_room_is_none(alloc: MemoryAllocator) -> None:
    frame = frame_of(torch.ones(4))
    assert NaiveSerializer().deserialize(frame, lambda shape, dtype: None) is None


def corruptions(frame: bytes) -> dict[str, bytes]:
    flip = lambda i: frame[:i] + bytes([frame[i] ^ 0x10]) + frame[i + 1:]  # noqa: E731
    return {
        "payload bit flip": flip(len(frame) - 3),
        "header bit flip": flip(10),
        "shape bit flip": flip(30),
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
        NaiveSerializer().deserialize(corruptions(frame)[case], alloc.allocate)
    assert alloc.live_objects == 0  # nothing allocated for a bad frame


def test_frame_of_another_serializer_is_rejected(alloc: MemoryAllocator) -> None:
    class Other(NaiveSerializer):
        name = "other"
        serializer_id = 200

    frame = Other().frame_bytes(tensor_obj(torch.ones(4)))
    with pytest.raises(CorruptFrameError, match="serializer id 200"):
        NaiveSerializer().deserialize(frame, alloc.allocate)
