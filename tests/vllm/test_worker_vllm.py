"""The vLLM worker side asks the GPU connector for the KV spec of vLLM's paged
caches (the connector reads their layout): nothing else looks at their shapes.

Runs in the vLLM venv (``.venv-vllm/bin/python -m pytest tests/vllm``); skipped
where vLLM is not installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.contracts.connector import KVSpec
from lmkv.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.vllm

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 2, 8, 16, 6


def caches(layout: str) -> dict[str, torch.Tensor]:
    shape = ((2, BLOCKS, BLOCK, HEADS, DIM) if layout == "flash"
             else (BLOCKS, HEADS, BLOCK, 2 * DIM))
    return {f"layer.{i}": torch.randn(shape) for i in range(LAYERS)}


def worker(tmp_path, head_size: int = DIM, **keys) -> WorkerSide:  # type: ignore[no-untyped-def]
    config = load_config(env={}, overrides={"lmkv.chunk_size": 16,
                                            "lmkv.lookup.runtime_dir": str(tmp_path), **keys})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", max_model_len=256,
                                     get_head_size=lambda: head_size),
        parallel_config=SimpleNamespace(world_size=1, rank=0),
        kv_transfer_config=SimpleNamespace(engine_id="w1"),
        cache_config=SimpleNamespace(block_size=BLOCK))
    return WorkerSide(config, vllm_config)


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_the_worker_takes_the_spec_the_connector_reads(tmp_path, layout: str) -> None:
    side = worker(tmp_path)
    kv = caches(layout)
    side.register(kv)
    try:
        # cpu caches: chunks in their order (heads outer), named lht2d
        assert side.engine.spec == KVSpec(LAYERS, HEADS, DIM, torch.float32,
                                          heads_outer=layout == "cpu")
        assert side.engine.chunker.meta.kv_layout == ("lht2d" if layout == "cpu" else "l2thd")
        tokens = list(range(32))
        assert side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1]) == 32
        before = [c.clone() for c in side.kv_caches]
        for c in side.kv_caches:
            c.zero_()
        got = side.engine.retrieve(tokens, kv_caches=side.kv_caches, block_ids=[4, 1])
        assert got.num_tokens == 32
        for c, b in zip(side.kv_caches, before, strict=True):
            part = (lambda t: t[:, [4, 1]]) if layout == "flash" else (lambda t: t[[4, 1]])
            assert torch.equal(part(c), part(b))
    finally:
        side.close()


def test_caches_whose_heads_are_not_the_models_are_refused(tmp_path) -> None:
    side = worker(tmp_path, head_size=DIM * 2)
    with pytest.raises(ValueError, match=f"heads of {DIM} elements; the model's head size "
                                         f"is {DIM * 2}"):
        side.register(caches("flash"))
    side.close()


def test_caches_in_no_known_layout_are_refused(tmp_path) -> None:
    side = worker(tmp_path)
    with pytest.raises(ValueError, match="expected a layout of flash"):
        side.register({"layer.0": torch.zeros(3, BLOCKS, BLOCK, HEADS, DIM)})
    side.close()


def test_a_connector_for_other_kv_is_refused(tmp_path) -> None:
    side = worker(tmp_path, **{"lmkv.gpu_connector": "hf"})
    with pytest.raises(ConfigError, match="'hf': cannot serve vLLM's paged KV caches"):
        side.register(caches("cpu"))
    side.close()


def test_a_store_stops_before_a_block_whose_load_failed_in_the_same_step(tmp_path) -> None:
    """A load that fails leaves stale bytes in its blocks, and the step's forward
    computes the rest of the request on top of them: the same step's store must
    not keep that KV (vLLM recomputes from the failed block)."""
    from lmkv.integrations.vllm.specs import LoadSpec, StoreSpec

    side = worker(tmp_path)
    kv = caches("flash")
    side.register(kv)
    try:
        stored = list(range(16))  # one chunk (16 tokens) is stored; the next is not
        assert side.engine.store(stored, kv_caches=side.kv_caches, block_ids=[0]) == 16
        prompt = stored + list(range(100, 132))  # 48 tokens: blocks 0, 1, 2
        # The step loads 32 tokens but only the first chunk is there: block 1 fails.
        side.load(SimpleNamespace(loads=[LoadSpec("r", prompt[:32], [0, 1, 2])], stores=[]))
        assert side.take_failed_blocks() == {1}
        side.save(SimpleNamespace(loads=[], stores=[StoreSpec("r", prompt, [0, 1, 2])]))
        assert side.engine.lookup(prompt) == 16, "stored KV computed over a failed block"
        # The next step has no failed load: the same store goes through.
        side.load(SimpleNamespace(loads=[], stores=[]))
        side.save(SimpleNamespace(loads=[], stores=[StoreSpec("r", prompt, [0, 1, 2])]))
        assert side.engine.lookup(prompt) == 48
    finally:
        side.close()


def test_an_mla_model_s_latent_is_copied_and_keyed_once_for_its_tp_ranks(tmp_path) -> None:
    """vLLM's MLA page ``[B, 1, N, latent]`` (one head slot: by shape, a cpu
    cache) is named mla by the worker; rank 1 of 2 tensor-parallel ranks keys
    its chunks as rank 0 does, as the latent is the same on both."""
    latent = 24
    config = load_config(env={}, overrides={"lmkv.chunk_size": 16,
                                            "lmkv.lookup.runtime_dir": str(tmp_path)})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", max_model_len=256, use_mla=True,
                                     get_head_size=lambda: latent),
        parallel_config=SimpleNamespace(world_size=2, rank=1, tensor_parallel_size=2),
        kv_transfer_config=SimpleNamespace(engine_id="w1"),
        cache_config=SimpleNamespace(block_size=BLOCK))
    side = WorkerSide(config, vllm_config)
    side.register({f"layer.{i}": torch.randn(BLOCKS, 1, BLOCK, latent) for i in range(LAYERS)})
    try:
        assert side.engine.spec == KVSpec(LAYERS, 1, latent, torch.float32, kv_planes=1,
                                          replicas=2)
        meta = side.engine.chunker.meta
        assert (meta.world_size, meta.worker_id, meta.kv_layout) == (1, 0, "l1thd")
        tokens = list(range(32))
        assert side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1]) == 32
        before = [c.clone() for c in side.kv_caches]
        for c in side.kv_caches:
            c.zero_()
        got = side.engine.retrieve(tokens, kv_caches=side.kv_caches, block_ids=[4, 1])
        assert got.num_tokens == 32
        for c, b in zip(side.kv_caches, before, strict=True):
            assert torch.equal(c[[4, 1]], b[[4, 1]])
    finally:
        side.close()


@pytest.mark.parametrize("cp", [{"decode_context_parallel_size": 2},
                                {"prefill_context_parallel_size": 2}])
def test_an_mla_model_under_context_parallelism_is_refused_in_one_line(tmp_path, cp) -> None:
    """Context parallelism shards an MLA group's tokens over its tensor-parallel
    ranks, whose latents lmkv keys once: refused at start (vLLM's own ParallelConfig)."""
    from vllm.config import ParallelConfig

    from lmkv.base.errors import ConfigError

    config = load_config(env={}, overrides={"lmkv.chunk_size": 16,
                                            "lmkv.lookup.runtime_dir": str(tmp_path)})

    def vllm_config(mla: bool, parallel):  # type: ignore[no-untyped-def]
        return SimpleNamespace(
            model_config=SimpleNamespace(model="m", max_model_len=256, use_mla=mla,
                                         get_head_size=lambda: 24),
            parallel_config=parallel, kv_transfer_config=SimpleNamespace(engine_id="w1"),
            cache_config=SimpleNamespace(block_size=BLOCK))

    with pytest.raises(ConfigError) as err:
        WorkerSide(config, vllm_config(True, ParallelConfig(tensor_parallel_size=2, **cp)))
    line = str(err.value)
    assert "\n" not in line and "context_parallel_size=2" in line and "MLA" in line
    WorkerSide(config, vllm_config(False, ParallelConfig(tensor_parallel_size=2, **cp))).close()
    WorkerSide(config, vllm_config(True, ParallelConfig(tensor_parallel_size=2))).close()


def _fp8_side(tmp_path, cache_config):  # type: ignore[no-untyped-def]
    config = load_config(env={}, overrides={"lmkv.chunk_size": 16,
                                            "lmkv.lookup.runtime_dir": str(tmp_path)})
    return WorkerSide(config, SimpleNamespace(
        model_config=SimpleNamespace(model="m", max_model_len=256, get_head_size=lambda: DIM),
        parallel_config=SimpleNamespace(world_size=1, rank=0),
        kv_transfer_config=SimpleNamespace(engine_id="w1"), cache_config=cache_config))


def test_fp8_caches_vllm_keeps_as_bytes_are_keyed_by_their_format(tmp_path) -> None:
    """vLLM allocates fp8, fp8_e4m3 and fp8_e5m2 caches all as torch.uint8: the
    worker names the format (e4m3 and e5m2 KV never share a key) and copies the
    bytes unchanged; a byte format it cannot name is refused in one line."""
    from vllm.config import CacheConfig

    from lmkv.base.errors import ConfigError

    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    raw = {f"layer.{i}": torch.randint(0, 256, shape, dtype=torch.uint8) for i in range(LAYERS)}
    keys = {}
    for cache_dtype, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        side = _fp8_side(tmp_path, CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype))
        side.register({n: c.clone() for n, c in raw.items()})
        try:
            assert side.engine.spec.dtype == dtype
            tokens = list(range(32))
            assert side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1]) == 32
            keys[cache_dtype] = side.engine.chunker.meta.dtype
            for c in side.kv_caches:
                c.view(torch.uint8).zero_()
            assert side.engine.retrieve(tokens, kv_caches=side.kv_caches,
                                        block_ids=[4, 1]).num_tokens == 32
            for c, r in zip(side.kv_caches, raw.values(), strict=True):
                assert torch.equal(c.view(torch.uint8)[:, [4, 1]], r[:, [4, 1]])
        finally:
            side.close()
    assert keys == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
    side = _fp8_side(tmp_path, CacheConfig(block_size=BLOCK, cache_dtype="turboquant_k8v4"))
    with pytest.raises(ConfigError, match="turboquant_k8v4") as err:
        side.register(raw)
    assert "\n" not in str(err.value)
    side.close()
    old = SimpleNamespace(block_size=BLOCK, cache_dtype="fp8", calculate_kv_scales=True)
    side = _fp8_side(tmp_path, old)  # (an older vLLM's flag: not in 0.32's CacheConfig)
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        side.register(raw)
    side.close()


def test_a_paged_subclass_with_copies_of_its_own_gets_canonical_chunks(
        tmp_path, register_lmkv_plugin) -> None:  # type: ignore[no-untyped-def]
    """A connector written for API 2.0 on the paged connector (its own copies, the
    paged connector's spec read through the class, not ``super()``) moves the
    canonical order: the worker names and holds its chunks so, never lht2d."""
    from lmkv.contracts import hookimpl
    from lmkv_backends.connectors.paged import PagedConnector

    class Logged(PagedConnector):
        name = "logged-paged"
        api_version = "2.0"
        copies = 0

        @classmethod
        def spec_from(cls, **kv):  # type: ignore[no-untyped-def, override]
            return PagedConnector.spec_from(**kv)  # (cls is PagedConnector in there)

        def to_chunks(self, spans, **kv):  # type: ignore[no-untyped-def, override]
            type(self).copies += 1
            for span in spans:  # the canonical order this class was written for
                assert span.buffer.shape[1] == 2
            return super().to_chunks(spans, **kv)

        def from_chunks(self, spans, **kv):  # type: ignore[no-untyped-def, override]
            type(self).copies += 1
            return super().from_chunks(spans, **kv)

    class Plugin:
        @hookimpl
        def lmkv_gpu_connectors(self):  # type: ignore[no-untyped-def]
            return [Logged]

    register_lmkv_plugin(Plugin())
    side = worker(tmp_path, **{"lmkv.gpu_connector": "logged-paged"})
    side.register(caches("cpu"))
    try:
        assert not side.engine.spec.heads_outer
        assert side.engine.chunker.meta.kv_layout == "l2thd"
        tokens = list(range(32))
        assert side.engine.store(tokens, kv_caches=side.kv_caches, block_ids=[4, 1]) == 32
        before = [c.clone() for c in side.kv_caches]
        for c in side.kv_caches:
            c.zero_()
        assert side.engine.retrieve(tokens, kv_caches=side.kv_caches,
                                    block_ids=[4, 1]).num_tokens == 32
        assert all(torch.equal(c[[4, 1]], b[[4, 1]])
                   for c, b in zip(side.kv_caches, before, strict=True))
        assert Logged.copies >= 2
    finally:
        side.close()
