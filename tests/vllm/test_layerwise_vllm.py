"""``lmkv.layerwise`` in the vLLM worker side: ``load`` returns at once and each
``wait_layer`` waits for its own layer; a failed or stuck load never hangs the
forward and reports its blocks (vLLM recomputes them); stores copy each layer
once the forward has produced it and publish whole chunks in ``save``.

Runs in the vLLM venv; the primitives are tested without vLLM in
tests/integrations/test_layerwise.py, the mode end to end in tests/vllm/e2e_vllm.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch

from lmkv.integrations.vllm.specs import LoadSpec, StoreSpec
from tests.vllm.test_worker_vllm import BLOCK, caches, worker

pytestmark = pytest.mark.vllm

NAMES = ["layer.0", "layer.1"]


def meta(loads=(), stores=()):  # type: ignore[no-untyped-def]
    return SimpleNamespace(loads=list(loads), stores=list(stores))


def layered(tmp_path):  # type: ignore[no-untyped-def]
    side = worker(tmp_path, **{"lmkv.layerwise": True})
    side.register(caches("flash"))
    return side


def hold_layer(side, layer: int) -> tuple[threading.Event, threading.Event]:  # type: ignore[no-untyped-def]
    """Hold the per-layer copy of ``layer`` until released: (reached, release)."""
    reached, release = threading.Event(), threading.Event()
    copy = side.layered.per_layer.from_chunks
    calls = [0]

    def held(spans, **kv):  # type: ignore[no-untyped-def]
        if calls[0] % len(NAMES) == layer:
            reached.set()
            release.wait(30)
        calls[0] += 1
        return copy(spans, **kv)

    side.layered.per_layer.from_chunks = held
    return reached, release


def test_a_layer_is_ready_while_later_layers_still_load(tmp_path) -> None:
    side = layered(tmp_path)
    try:
        tokens = list(range(32))
        side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1])
        want = [c[:, [4, 1]].clone() for c in side.kv_caches]
        for c in side.kv_caches:
            c.zero_()
        reached, release = hold_layer(side, 1)
        side.load(meta([LoadSpec("r", tokens, [4, 1])]))  # returns while layer 1 is held
        side.wait_layer("layer.0")
        assert reached.wait(30)
        assert torch.equal(side.kv_caches[0][:, [4, 1]], want[0])
        assert not side.kv_caches[1].any(), "layer 1 was copied before its copy started"
        assert not side._load_step.gate.wait(1, 0.05)  # layer 1: still loading
        release.set()
        side.wait_layer("layer.1")
        assert torch.equal(side.kv_caches[1][:, [4, 1]], want[1])
        assert side.take_failed_blocks() == set()
        assert (side.counters.layerwise_loads, side.counters.loaded_tokens) == (1, 32)
    finally:
        side.close()


def test_a_load_that_raises_opens_every_layer_and_fails_its_blocks(tmp_path, caplog) -> None:
    side = layered(tmp_path)

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated: the tier went away")

    side.engine.retrieve = boom
    try:
        side.load(meta([LoadSpec("r", list(range(32)), [4, 1, 2])]))
        with caplog.at_level(logging.WARNING, logger="lmkv"):
            for name in NAMES:
                side.wait_layer(name)
        assert "not loaded within" not in caplog.text  # released, not timed out
        assert side.take_failed_blocks() == {4, 1}
    finally:
        side.close()


def test_a_stuck_load_is_given_up_and_never_writes_afterwards(tmp_path) -> None:
    side = layered(tmp_path)
    side.layer_timeout_s = 0.05
    tokens = list(range(32))
    side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1])
    for c in side.kv_caches:
        c.zero_()
    retrieve, entered, unstick = side.engine.retrieve, threading.Event(), threading.Event()

    def stuck(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        unstick.wait(30)  # a tier that hangs, then answers after the step
        return retrieve(*args, **kwargs)

    side.engine.retrieve = stuck
    try:
        side.load(meta([LoadSpec("r", tokens, [4, 1])]))
        assert entered.wait(30)
        side.wait_layer("layer.0")  # times out: the step's loads are given up
        side.wait_layer("layer.1")
        assert side.take_failed_blocks() == {4, 1}  # vLLM recomputes them
        unstick.set()
        side._layer_loader.submit(lambda: None).result(30)  # the stuck load ended
        assert not any(c.any() for c in side.kv_caches), "a given-up load wrote KV"
    finally:
        unstick.set()
        side.close()


def test_a_store_copies_each_layer_once_produced_and_publishes_in_save(tmp_path) -> None:
    side = layered(tmp_path)
    tokens = list(range(32))
    step = meta(stores=[StoreSpec("r", tokens, [2, 5])])
    try:
        side.layer_saved("layer.0", step)
        side.kv_caches[1][:, [2, 5]] = 7.0  # the forward writes layer 1, then saves it
        side.layer_saved("layer.1", step)
        want = [c[:, [2, 5]].clone() for c in side.kv_caches]
        side.save(step)
        assert side.counters.layerwise_stores == 1 and side.counters.stored_tokens == 32
        for c in side.kv_caches:
            c.zero_()
        assert side.engine.retrieve(tokens, kv_caches=side.kv_caches,
                                    block_ids=[2, 5]).num_tokens == 32
        for c, w in zip(side.kv_caches, want, strict=True):
            assert torch.equal(c[:, [2, 5]], w)
        assert side.kv_caches[1][:, [2, 5]].eq(7.0).all()
    finally:
        side.close()


def test_a_step_without_a_forward_stores_in_save(tmp_path) -> None:
    side = layered(tmp_path)
    try:
        side.save(meta(stores=[StoreSpec("r", list(range(16)), [3], release=True)]))
        assert side.engine.lookup(list(range(16))) == 16
        assert side.take_finished_saves() == {"r"}
    finally:
        side.close()


def test_a_layered_store_stops_before_a_block_whose_load_failed(tmp_path) -> None:
    side = layered(tmp_path)
    try:
        stored = list(range(16))
        side.engine.store(stored, kv_caches=side.kv_caches, block_ids=[0])
        prompt = stored + list(range(100, 132))  # 48 tokens: blocks 0, 1, 2
        step = meta([LoadSpec("r", prompt[:32], [0, 1, 2])], [StoreSpec("r", prompt, [0, 1, 2])])
        side.load(step)  # the second chunk is not stored: block 1 fails
        for name in NAMES:
            side.wait_layer(name)
            side.layer_saved(name, step)
        side.save(step)
        assert side.take_failed_blocks() == {1}
        assert side.engine.lookup(prompt) == 16, "stored KV computed over a failed block"
    finally:
        side.close()


def test_without_layerwise_nothing_waits_and_nothing_is_copied_per_layer(tmp_path) -> None:
    side = worker(tmp_path)
    side.register(caches("flash"))
    try:
        assert side.layered is None
        side.load(meta([LoadSpec("r", list(range(BLOCK)), [0])]))
        side.wait_layer("layer.0")
        side.layer_saved("layer.0", meta())
        assert side._load_step is None and side._store_step is None
    finally:
        side.close()


def test_layerwise_through_an_lmkv_server(tmp_path) -> None:
    """Server mode: the chunk views the server lends are scattered layer by layer,
    and a layered store publishes through the server; a second worker loads it."""
    import os
    import sys

    from lmkv.testing.server import spawn_server

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    server, address = spawn_server(tmp_path, "tiers:\n  - type: cpu\n    options: "
                                   "{max_bytes: 64MiB}\n", env=env)
    keys = {"lmkv.layerwise": True, "lmkv.mode": "server", "lmkv.server.address": address,
            "lmkv.server.timeout_ms": 5000}
    writer, reader = worker(tmp_path, **keys), worker(tmp_path, **keys)
    try:
        writer.register(caches("flash"))
        reader.register(caches("flash"))
        tokens = list(range(32))
        step = meta(stores=[StoreSpec("r", tokens, [2, 5])])
        for name in NAMES:
            writer.layer_saved(name, step)
        writer.save(step)
        assert writer.counters.layerwise_stores == 1
        reader.load(meta([LoadSpec("r2", tokens, [1, 3])]))
        for name in NAMES:
            reader.wait_layer(name)
        assert reader.take_failed_blocks() == set()
        assert reader.counters.loaded_tokens == 32
        for w, r in zip(writer.kv_caches, reader.kv_caches, strict=True):
            assert torch.equal(w[:, [2, 5]], r[:, [1, 3]])
    finally:
        with contextlib.ExitStack() as stack:  # each closed whatever the others raise
            stack.callback(server.wait, 60)
            stack.callback(server.terminate)
            stack.callback(reader.close)
            stack.callback(writer.close)


def test_the_connector_asks_for_piecewise_cuda_graphs_only_when_layerwise() -> None:
    from lmkv.integrations.vllm.connector import LMKVConnector

    assert LMKVConnector.requires_piecewise_for_cudagraph({"lmkv.layerwise": True})
    assert LMKVConnector.requires_piecewise_for_cudagraph({"lmcache.use_layerwise": "true"})
    assert not LMKVConnector.requires_piecewise_for_cudagraph({})
    assert not LMKVConnector.requires_piecewise_for_cudagraph({"lmkv.layerwise": "no!"})


class _ThreadedCuda:
    """``torch.cuda`` STUBBED (no GPU here), with torch's per-thread current stream:
    the test's thread is vLLM's forward thread (its stream "forward"); lmkv's own
    threads see the default stream, as they do under vLLM."""

    def __new__(cls):  # type: ignore[no-untyped-def]
        from tests.memory.test_transfer_stream import FakeCuda, FakeStream

        class Threaded(FakeCuda):
            def __init__(self) -> None:
                super().__init__()
                self._local = threading.local()
                self.forward_thread = threading.get_ident()
                self.forward = FakeStream(self, "forward")
                self.default = FakeStream(self, "default")

            @property
            def current(self):  # type: ignore[no-untyped-def]
                mine = getattr(self._local, "stream", None)
                if mine is not None:
                    return mine
                return self.forward if threading.get_ident() == self.forward_thread \
                    else self.default

            @current.setter
            def current(self, stream) -> None:  # type: ignore[no-untyped-def]
                if hasattr(self, "_local"):
                    self._local.stream = None if stream in (self.forward, self.default) \
                        else stream

        return Threaded()


def test_copies_from_lmkv_threads_wait_for_the_forward_stream_not_their_own(
        tmp_path, monkeypatch) -> None:
    """CUDA STUBBED: the copies run for real on CPU tensors; what is checked is that
    every copy issued on lmkv's loader and store threads waits for an event recorded
    on the forward's stream (for a layerwise store: the one recorded when that layer
    was produced), never for the calling thread's default stream."""
    from lmkv.memory import transfer_stream
    from lmkv.memory.transfer_stream import TransferStream

    cuda = _ThreadedCuda()
    monkeypatch.setitem(transfer_stream._streams, torch.device("cpu"),
                        TransferStream("cpu", cuda=cuda))
    side = layered(tmp_path)
    try:
        tokens = list(range(32))
        step = meta(stores=[StoreSpec("r", tokens, [2, 5])])
        produced = []
        for name in NAMES:  # the forward thread: each layer's event on its stream
            side.layer_saved(name, step)
            produced.append(next(e[1] for e in reversed(cuda.log) if e[0] == "record"))
        side.save(step)
        side.load(meta([LoadSpec("r2", tokens, [1, 3])]))  # the layerwise loader thread
        for name in NAMES:
            side.wait_layer(name)
        assert side.take_failed_blocks() == set()
        recorded = {e[1]: e[2] for e in cuda.log if e[0] == "record"}
        waits = [e[2] for e in cuda.log if e[:2] == ("wait_event", "transfer")]
        assert len(waits) == 4  # two layers stored, two loaded
        assert waits[:2] == produced  # each layer's store after its own forward event
        assert all(recorded[e] == "forward" for e in waits), (waits, recorded)
        # nothing is ordered on the loader and store threads' own (default) stream
        assert not any("default" in e for e in cuda.log), cuda.log
        # a lazy store (the lazy-store thread) and an asynchronous load (the
        # async-load thread): each after the event marked on the forward's stream
        cuda.log.clear()
        side.save(meta(stores=[StoreSpec("lazy", list(range(100, 132)), [0, 3],
                                         store_id="s1")]))
        side.load(meta([LoadSpec("r3", tokens, [4, 1], async_load=True)]))
        deadline = time.monotonic() + 30
        loaded, confirmed = set(), None
        while (not loaded or confirmed is None) and time.monotonic() < deadline:
            loaded |= side.take_finished_loads() or set()
            confirmed = confirmed or side.take_worker_meta()
            time.sleep(0.01)
        assert loaded == {"r3"} and confirmed is not None
        recorded = {e[1]: e[2] for e in cuda.log if e[0] == "record"}
        waits = [e[2] for e in cuda.log if e[:2] == ("wait_event", "transfer")]
        assert len(waits) == 2 and all(recorded[e] == "forward" for e in waits)
        assert not any("default" in e for e in cuda.log), cuda.log
    finally:
        side.close()


def test_a_layered_store_through_the_inline_data_path_stores_every_batch(tmp_path) -> None:
    """Server mode without shared memory: a store goes out in batches of what one
    request holds (here one chunk each), each filled by its own connector call; a
    layered store copies every batch, not only the first."""
    import os
    import sys

    from lmkv.testing.server import spawn_server

    chunk_bytes = 2 * 2 * 16 * 2 * 8 * 4  # layers, K/V, tokens, heads, dim, float32
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    server, address = spawn_server(  # room for one chunk a request (and the header room)
        tmp_path, "tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n", env=env,
        args=["--max-request-bytes", str((1 << 16) + chunk_bytes + chunk_bytes // 2)])
    keys = {"lmkv.layerwise": True, "lmkv.mode": "server", "lmkv.server.address": address,
            "lmkv.server.timeout_ms": 5000, "lmkv.server.data_path": "inline"}
    writer, reader = worker(tmp_path, **keys), worker(tmp_path, **keys)
    try:
        writer.register(caches("flash"))
        reader.register(caches("flash"))
        tokens = list(range(32))  # two chunks: two batches
        step = meta(stores=[StoreSpec("r", tokens, [2, 5])])
        for name in NAMES:
            writer.layer_saved(name, step)
        writer.save(step)
        assert writer.counters.stored_tokens == 32
        assert reader.engine.lookup(tokens) == 32
        reader.load(meta([LoadSpec("r2", tokens, [1, 3])]))
        for name in NAMES:
            reader.wait_layer(name)
        assert reader.take_failed_blocks() == set()
        for w, r in zip(writer.kv_caches, reader.kv_caches, strict=True):
            assert torch.equal(w[:, [2, 5]], r[:, [1, 3]])
    finally:
        with contextlib.ExitStack() as stack:  # each closed whatever the others raise
            stack.callback(server.wait, 60)
            stack.callback(server.terminate)
            stack.callback(reader.close)
            stack.callback(writer.close)
