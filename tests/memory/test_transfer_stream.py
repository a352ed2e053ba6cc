"""The transfer stream: the order of events, waits and copies, and the CPU path.

There is no GPU here: the CUDA tests run with ``torch.cuda``'s streams and
events STUBBED by the fakes below (``FakeCuda``), which record every call in
order; the copies themselves run for real on CPU tensors. What they check is
the ordering the module promises (docs/gpu.md), not CUDA itself. The CPU-path
tests use the real, synchronous path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import lmkv.engines.local as local_engine
from lmkv import load_config
from lmkv.contracts.connector import KVSpec
from lmkv.memory import transfer_stream
from lmkv.memory.transfer_stream import DONE, TransferStream, stream_for
from lmkv.testing.engines import open_local_engine
from lmkv_backends.connectors import paged as paged_module

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32


class FakeEvent:
    """A CUDA event stub: completes when synchronized (or when a test says so)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.name = f"e{cuda.events}"
        cuda.events += 1
        self.completed = False

    def record(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        self.cuda.log.append(("query", self.name))
        return self.completed

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name))
        self.completed = True


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str = "transfer", device=None) -> None:
        self.cuda = cuda
        self.name = name

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        raise AssertionError(f"stream {self.name} synchronized as a whole")


class FakeCuda:
    """Stands in for ``torch.cuda``: one compute stream, streams and events that log."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.events = 0
        self.compute = FakeStream(self, "compute")
        self.current = self.compute

    def Stream(self, device=None) -> FakeStream:
        return FakeStream(self, "transfer", device)

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("exit", stream.name))

    def copy(self) -> None:
        """A copy's stand-in: logs the stream it was issued on."""
        self.log.append(("copy", self.current.name))


@pytest.fixture
def no_device_sync(monkeypatch) -> None:
    """A device-wide synchronize anywhere fails the test."""
    def refuse(*_a, **_k) -> None:
        raise AssertionError("torch.cuda.synchronize() called")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_a_store_copies_after_the_compute_event_and_is_done_only_after_its_own(
        no_device_sync) -> None:
    cuda = FakeCuda()
    transfer = TransferStream("cuda:0", cuda=cuda).store(cuda.copy)
    assert cuda.log == [
        ("record", "e0", "compute"),  # after the forward that wrote the KV
        ("wait_event", "transfer", "e0"),  # on the GPU: the host does not wait
        ("enter", "transfer"), ("copy", "transfer"), ("exit", "transfer"),
        ("record", "e1", "transfer"),  # the copy's own event
    ]  # and the compute stream never waits for a store
    assert not transfer.ready()  # polled: the copy is still running
    transfer.wait()
    assert cuda.log[-2:] == [("query", "e1"), ("synchronize", "e1")]  # that event only
    assert transfer.ready()


def test_a_load_makes_the_compute_stream_wait_for_its_event_on_the_gpu(no_device_sync) -> None:
    cuda = FakeCuda()
    transfer = TransferStream("cuda:0", cuda=cuda).load(cuda.copy)
    assert cuda.log == [
        ("record", "e0", "compute"),
        ("wait_event", "transfer", "e0"),
        ("enter", "transfer"), ("copy", "transfer"), ("exit", "transfer"),
        ("record", "e1", "transfer"),
        ("wait_event", "compute", "e1"),  # the layers that read it run after the copy
    ]
    transfer.wait()
    assert ("synchronize", "e1") in cuda.log


def test_loads_issued_ahead_make_the_compute_stream_wait_only_when_told() -> None:
    # layer by layer: every layer's load is issued first, the compute stream waits
    # for layer i's only before layer i is queued
    cuda = FakeCuda()
    stream = TransferStream("cuda:0", cuda=cuda)
    layers = [stream.load(cuda.copy, compute_waits=False) for _ in range(2)]
    assert not any(e[:2] == ("wait_event", "compute") for e in cuda.log)
    layers[0].order_before_compute()
    assert cuda.log[-1] == ("wait_event", "compute", "e1")  # layer 0's copy event
    layers[1].order_before_compute()
    assert cuda.log[-1] == ("wait_event", "compute", "e3")
    DONE.order_before_compute()  # a synchronous copy: nothing to wait for


def test_waiting_for_a_copy_that_is_done_does_not_block() -> None:
    cuda = FakeCuda()
    transfer = TransferStream("cuda:0", cuda=cuda).store(cuda.copy)
    transfer.done.completed = True
    transfer.wait()
    assert cuda.log[-1] == ("query", "e1")  # polled, found done, no synchronize


def _paged_engine():
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                            "lmkv.gpu_connector": "paged"})
    return open_local_engine(config, SPEC, model_name="streams", kv_kind="paged")


def test_the_paged_connector_publishes_stores_and_releases_loads_only_after_their_events(
        monkeypatch, no_device_sync) -> None:
    # The stubbed transfer stream stands in for the CPU device's: the connector and the
    # engine run for real, the copies too (CPU tensors), and every step is logged.
    cuda = FakeCuda()
    monkeypatch.setitem(transfer_stream._streams, torch.device("cpu"),
                        TransferStream("cpu", cuda=cuda))
    gather, scatter = paged_module.lmkv_kernels.gather_blocks, \
        paged_module.lmkv_kernels.scatter_blocks

    def logged(name, fn):
        def run(*args, **kwargs):
            cuda.log.append((name, cuda.current.name))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(paged_module.lmkv_kernels, "gather_blocks", logged("gather", gather))
    monkeypatch.setattr(paged_module.lmkv_kernels, "scatter_blocks", logged("scatter", scatter))
    caches = [torch.randn(8, 2, 16, 32).half() for _ in range(2)]
    target = [torch.zeros_like(c) for c in caches]
    with _paged_engine() as engine:
        put = engine.storage.put

        def publish(keys, objs, *args, **kwargs):
            cuda.log.append(("publish", len(objs)))
            return put(keys, objs, *args, **kwargs)

        monkeypatch.setattr(engine.storage, "put", publish)
        real_release = local_engine.release  # the engine releases what it loaded
        monkeypatch.setattr(local_engine, "release", lambda objs: (
            cuda.log.append(("release", len(objs))), real_release(objs)))
        tokens = list(range(64))
        assert engine.store(tokens, kv_caches=caches, block_ids=[3, 1, 6, 0]) == 64
        stored = cuda.log[:]
        cuda.log.clear()
        got = engine.retrieve(tokens, kv_caches=target, block_ids=[7, 2, 5, 4])
        loaded = cuda.log[:]
    assert stored == [
        ("record", "e0", "compute"), ("wait_event", "transfer", "e0"),
        ("enter", "transfer"), ("gather", "transfer"), ("exit", "transfer"),
        ("record", "e1", "transfer"),
        ("query", "e1"), ("synchronize", "e1"),  # the copy is done...
        ("publish", 2),  # ...before its buffers reach the tier
    ]
    assert loaded[:8] == [
        ("record", "e2", "compute"), ("wait_event", "transfer", "e2"),
        ("enter", "transfer"), ("scatter", "transfer"), ("exit", "transfer"),
        ("record", "e3", "transfer"), ("wait_event", "compute", "e3"),
        ("query", "e3"),
    ]
    assert loaded[8:] == [("synchronize", "e3"), ("release", 2)]  # released after it
    assert got.num_tokens == 64
    for a, b in zip([3, 1, 6, 0], [7, 2, 5, 4], strict=True):  # and the bytes are right
        assert all(torch.equal(src[a], dst[b]) for src, dst in zip(caches, target, strict=True))


def test_without_cuda_the_copies_run_at_once_and_are_bit_exact(no_device_sync) -> None:
    stream = stream_for("cpu")
    assert stream.synchronous and stream is stream_for(torch.device("cpu"))
    ran = []
    assert stream.store(lambda: ran.append("store")) is DONE and ran == ["store"]
    assert stream.load(lambda: ran.append("load")) is DONE and ran == ["store", "load"]
    assert DONE.ready()
    # a paged round trip through the real CPU path, every dtype bit for bit
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)
        config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                                "lmkv.gpu_connector": "paged"})
        caches = [torch.randn(8, 2, 16, 32).to(dtype) for _ in range(2)]
        target = [torch.full_like(c, -1) for c in caches]
        with open_local_engine(config, spec, model_name=f"cpu-{dtype}",
                               kv_kind="paged") as engine:
            tokens = list(range(100))  # 3 whole chunks and a partial one (not stored)
            assert engine.store(tokens, kv_caches=caches, block_ids=[3, 1, 6, 0, 2, 5, 4]) == 96
            got = engine.retrieve(tokens, kv_caches=target, block_ids=[7, 2, 5, 4, 1, 0, 3])
        assert got.num_tokens == 96
        src = torch.cat([c.view(8, 2, 16, 2, 16)[[3, 1, 6, 0, 2, 5]] for c in caches])
        dst = torch.cat([c.view(8, 2, 16, 2, 16)[[7, 2, 5, 4, 1, 0]] for c in target])
        # the cpu layout [blocks, heads, block_size, 2 * head_dim]: tokens 0..95 are
        # the first 6 blocks; compare them byte for byte
        assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here: "
                    "the stubbed tests above check the ordering)")
def test_on_a_gpu_paged_stores_and_loads_are_bit_exact_without_a_device_sync(
        no_device_sync) -> None:
    stream = stream_for("cuda")
    assert not stream.synchronous
    caches = [torch.randn(2, 8, 16, 2, 16, device="cuda").half() for _ in range(2)]  # flash
    target = [torch.zeros_like(c) for c in caches]
    with _paged_engine() as engine:
        tokens = list(range(64))
        assert engine.store(tokens, kv_caches=caches, block_ids=[3, 1, 6, 0]) == 64
        assert engine.retrieve(tokens, kv_caches=target, block_ids=[7, 2, 5, 4]).num_tokens == 64
    torch.cuda.current_stream().synchronize()  # (the test's own read, not lmkv's)
    for src, dst in zip(caches, target, strict=True):
        assert torch.equal(src[:, [3, 1, 6, 0]].cpu(), dst[:, [7, 2, 5, 4]].cpu())


def test_after_names_the_forward_stream_or_its_event_instead_of_the_callers(
        no_device_sync) -> None:
    # CUDA STUBBED: the caller's current stream ("compute" here) is not the forward's:
    # a store after the forward's event waits for that event only; a load after the
    # forward's stream records there and makes that stream wait for the copy.
    cuda = FakeCuda()
    stream = TransferStream("cuda:0", cuda=cuda)
    forward = FakeStream(cuda, "forward")
    event = cuda.Event()  # e0: as recorded on the forward's stream by mark()
    stream.store(cuda.copy, after=event)
    assert cuda.log[0] == ("wait_event", "transfer", "e0")
    assert not any(e[0] == "record" and e[2] == "compute" for e in cuda.log)
    stream.load(cuda.copy, after=event)  # no stream named: none made to wait
    assert not any(e[0] == "wait_event" and e[1] != "transfer" for e in cuda.log)
    cuda.log.clear()
    stream.load(cuda.copy, after=forward)
    assert cuda.log[0] == ("record", "e3", "forward")
    assert cuda.log[1] == ("wait_event", "transfer", "e3")
    assert cuda.log[-1] == ("wait_event", "forward", "e4")
    cuda.current = forward
    assert stream.current() is forward
    assert stream.mark().name == "e5" and cuda.log[-1] == ("record", "e5", "forward")
