"""The zstd (lossless) and int8 (lossy) serializers."""

from __future__ import annotations

import pytest
import torch

from lmkv.base.errors import CorruptFrameError
from lmkv.memory import MemoryAllocator, tensor_obj
from lmkv_backends.serde.int8 import Int8Serializer
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.serde.zstd import ZstdSerializer
from tests.contracts.test_serde import KEY, corruptions

SHAPE = (2, 2, 32, 2, 16)


@pytest.fixture
def alloc() -> MemoryAllocator:
    return MemoryAllocator(1 << 22)


def kv_like(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values shaped like attention KV: mostly small, a few large channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=gen)
    x[..., 3] *= 8
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("options", [{}, {"shuffle": False}, {"level": 19}])
def test_zstd_is_lossless(dtype, options, alloc) -> None:
    data = kv_like(torch.float32).mul(10).to(dtype)
    ser = ZstdSerializer(options)
    obj = ser.deserialize(ser.frame_bytes(tensor_obj(data), KEY), alloc.allocate, KEY)
    assert torch.equal(obj.tensor.view(torch.uint8), data.view(torch.uint8))
    obj.ref_down()


def test_zstd_shuffle_compresses_kv(alloc) -> None:
    data = kv_like(torch.bfloat16)
    raw = len(NaiveSerializer().frame_bytes(tensor_obj(data), KEY))
    plain = len(ZstdSerializer({"shuffle": False}).frame_bytes(tensor_obj(data), KEY))
    shuffled = len(ZstdSerializer().frame_bytes(tensor_obj(data), KEY))
    assert shuffled < plain <= raw * 1.01
    assert shuffled < 0.9 * raw


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_error_is_bounded_by_half_a_step(granularity, dtype, alloc) -> None:
    data = kv_like(dtype)
    ser = Int8Serializer({"granularity": granularity})
    frame = ser.frame_bytes(tensor_obj(data), KEY)
    assert len(frame) < data.numel() * data.element_size() * 0.6 or dtype != torch.float32
    obj = ser.deserialize(frame, alloc.allocate, KEY)
    assert obj.dtype == dtype and tuple(obj.shape) == SHAPE
    x = data.float()
    dim = -1 if granularity == "token" else 2
    step = x.abs().amax(dim=dim, keepdim=True) / 127
    err = (obj.tensor.float() - x).abs()
    # half a quantization step, plus the rounding of the output dtype
    assert torch.all(err <= step / 2 + x.abs() * 2 ** -7 + 1e-6)
    assert float(err.max()) > 0  # it is lossy: a test of a no-op would pass the bound too
    obj.ref_down()


def test_int8_of_zeros_is_exact(alloc) -> None:
    data = torch.zeros(SHAPE, dtype=torch.bfloat16)
    obj = Int8Serializer().deserialize(Int8Serializer().frame_bytes(tensor_obj(data), KEY),
                                       alloc.allocate, KEY)
    assert torch.equal(obj.tensor, data)
    obj.ref_down()


@pytest.mark.parametrize("ser", [ZstdSerializer(), Int8Serializer()], ids=["zstd", "int8"])
@pytest.mark.parametrize("case", list(corruptions(b"\0" * 300)))
def test_corrupt_frames_raise(ser, case, alloc) -> None:
    frame = ser.frame_bytes(tensor_obj(kv_like(torch.float16)), KEY)
    with pytest.raises(CorruptFrameError):
        ser.deserialize(corruptions(frame)[case], alloc.allocate, KEY)
    assert alloc.live_objects == 0


def test_serializers_refuse_each_others_frames(alloc) -> None:
    sers = [NaiveSerializer(), ZstdSerializer(), Int8Serializer()]
    data = tensor_obj(kv_like(torch.float16))
    for writer in sers:
        frame = writer.frame_bytes(data, KEY)
        for reader in sers:
            if reader is writer:
                continue
            with pytest.raises(CorruptFrameError, match="serializer id"):
                reader.deserialize(frame, alloc.allocate, KEY)
