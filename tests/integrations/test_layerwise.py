"""The pieces of ``lmkv.layerwise`` (lmkv.integrations.vllm.layerwise), without vLLM:
the per-layer gate the forward waits on, the guard that stops a step's copies,
and the connector wrapper that copies layer by layer (the built-in ``paged``
connector on CPU tensors underneath). The worker's use of them against vLLM's
metadata is in tests/vllm/test_layerwise_vllm.py."""

from __future__ import annotations

import threading

import pytest
import torch

from lmkv.contracts.connector import ChunkSpan, ConnectorContext, KVSpec
from lmkv.integrations.vllm.layerwise import (
    CopyCancelled,
    CopyGuard,
    LayeredConnector,
    LayerGate,
    LoadStep,
    Pace,
    StoreStep,
)
from lmkv_backends.connectors.paged import PagedConnector

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 2, 4, 4, 6
SPEC = KVSpec(LAYERS, HEADS, DIM, torch.float32)


def caches() -> list[torch.Tensor]:
    return [torch.randn(2, BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]


def layered() -> LayeredConnector:
    return LayeredConnector.around(PagedConnector({}, ConnectorContext(SPEC)),
                                   lambda ctx: PagedConnector({}, ctx))


def test_a_wait_returns_once_its_layer_is_ready_and_not_before() -> None:
    gate = LayerGate(LAYERS)
    assert not gate.wait(0, 0.01)
    gate.advance(1)
    assert gate.wait(0, 0.01) and not gate.wait(1, 0.01)
    gate.advance(0)  # never goes back
    assert gate.ready == 1
    waiting = threading.Thread(target=lambda: result.append(gate.wait(2, 30)))
    result: list[bool] = []
    waiting.start()
    gate.open_all()
    waiting.join(30)
    assert result == [True] and gate.ready == LAYERS


def test_no_copy_starts_once_the_guard_is_cancelled() -> None:
    guard = CopyGuard()
    with guard.copying():
        pass
    guard.cancel()
    with pytest.raises(CopyCancelled), guard.copying():
        pytest.fail("a copy ran after cancel")


def test_cancel_waits_for_the_copy_in_progress() -> None:
    guard = CopyGuard()
    inside, release, cancelled = threading.Event(), threading.Event(), threading.Event()

    def copy() -> None:
        with guard.copying():
            inside.set()
            release.wait(30)

    copier = threading.Thread(target=copy)
    copier.start()
    inside.wait(30)
    canceller = threading.Thread(target=lambda: (guard.cancel(), cancelled.set()))
    canceller.start()
    assert not cancelled.wait(0.2), "cancel returned while a layer was being copied"
    release.set()
    assert cancelled.wait(30)
    copier.join(30)
    canceller.join(30)


def test_a_layered_load_equals_the_whole_load_and_reports_each_layer() -> None:
    whole, by_layer = caches(), caches()
    for a, b in zip(whole, by_layer, strict=True):
        b.copy_(a)
    chunk = torch.randn(SPEC.chunk_shape(8))
    spans = [ChunkSpan(0, 8, chunk)]
    blocks = [5, 2]
    conn = layered()
    conn.from_chunks(spans, kv_caches=whole, block_ids=blocks)
    seen: list[int] = []
    conn.from_chunks(spans, kv_caches=by_layer, block_ids=blocks,
                     pace=Pace(CopyGuard(), progress=seen.append))
    assert seen == [1, 2, 3]
    for a, b in zip(whole, by_layer, strict=True):
        assert torch.equal(a, b)
    assert not conn.writes_in_place  # one call for every chunk of a retrieve
    pace = Pace(CopyGuard())
    conn.from_chunks(spans, kv_caches=by_layer, block_ids=blocks, pace=pace)
    with pytest.raises(RuntimeError, match="more than one call"):
        conn.from_chunks(spans, kv_caches=by_layer, block_ids=blocks, pace=pace)
    # a store may come in several calls (the server's inline path, batch by batch)
    store = Pace(CopyGuard())
    out = [torch.zeros_like(chunk), torch.zeros_like(chunk)]
    for buf in out:
        conn.to_chunks([ChunkSpan(0, 8, buf)], kv_caches=by_layer, block_ids=blocks, pace=store)
    assert torch.equal(out[0], chunk) and torch.equal(out[1], chunk)


def test_a_layered_store_copies_a_layer_only_once_it_is_produced() -> None:
    kv = caches()
    buffer = torch.zeros(SPEC.chunk_shape(8))
    step = StoreStep(LAYERS)
    first_copied = threading.Event()
    pace = Pace(step.guard, source=step.produced,
                progress=lambda n: first_copied.set() if n == 1 else None)
    copier = threading.Thread(target=layered().to_chunks, args=([ChunkSpan(0, 8, buffer)],),
                              kwargs={"kv_caches": kv, "block_ids": [1, 3], "pace": pace})
    step.layer_produced(0)
    step.layer_produced(2)  # out of order: layer 2 waits for layer 1
    copier.start()
    assert first_copied.wait(30)
    kv[1].fill_(1.0)  # the forward writes layers 1 and 2, then says layer 1 is done
    kv[2].fill_(2.0)
    step.layer_produced(1)
    copier.join(30)
    assert not copier.is_alive()
    want = torch.zeros(SPEC.chunk_shape(8))
    PagedConnector({}, ConnectorContext(SPEC)).to_chunks([ChunkSpan(0, 8, want)],
                                                         kv_caches=kv, block_ids=[1, 3])
    assert torch.equal(buffer, want)
    assert buffer[1].eq(1.0).all() and buffer[2].eq(2.0).all()


def test_a_store_whose_layer_never_comes_is_given_up() -> None:
    step = StoreStep(LAYERS)
    buffer = torch.zeros(SPEC.chunk_shape(4))
    with pytest.raises(CopyCancelled, match="layer 0 was not produced"):
        layered().to_chunks([ChunkSpan(0, 4, buffer)], kv_caches=caches(), block_ids=[0],
                            pace=Pace(step.guard, source=step.produced, timeout_s=0.01))
    assert step.guard.cancelled and not buffer.any()


def test_giving_a_load_step_up_fails_every_block_of_the_loads_not_finished() -> None:
    class Spec:  # what LoadStep reads of a LoadSpec
        def __init__(self, n: int, blocks: list[int], skip: int = 0) -> None:
            self.token_ids, self.block_ids, self.skip_tokens = list(range(n)), blocks, skip

    step = LoadStep(LAYERS, BLOCK, [Spec(8, [0, 1]), Spec(12, [2, 3, 4, 5], skip=4)])
    step.load_done({1})  # the first load came up one block short
    assert step.give_up() == {1, 3, 4}  # the second's blocks past what vLLM holds
    assert step.gate.ready == LAYERS and step.done.is_set() and step.guard.cancelled
    step.load_done({5})  # a load that ends after the give-up changes nothing
    assert step.failed == {1, 3, 4}


def test_the_key_is_a_boolean_and_a_bad_value_is_one_line() -> None:
    from lmkv.base.errors import ConfigError
    from lmkv.integrations.vllm.config import config_from_extra

    assert config_from_extra({}).layerwise is False
    assert config_from_extra({"lmkv.layerwise": True}).layerwise is True
    assert config_from_extra({"lmcache.use_layerwise": "true"}).layerwise is True
    with pytest.raises(ConfigError) as info:
        config_from_extra({"lmkv.layerwise": "sometimes"})
    assert str(info.value) == ("config key 'layerwise' = 'sometimes' (from lmkv.layerwise): "
                               "must be true or false")
