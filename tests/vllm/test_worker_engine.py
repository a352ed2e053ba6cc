"""The vLLM worker opens its engine through ``open_engine``: the connector is
resolved once, in ``lmkv.engines.connector``. Skipped where vLLM is not installed
(the worker module imports vLLM's metadata classes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lmkv.engines.connector as connector_module
from lmkv import load_config
from lmkv.engines import Engine
from lmkv_backends.connectors.paged import PagedConnector

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def test_the_vllm_worker_opens_its_engine_through_open_engine(tmp_path, monkeypatch) -> None:
    """The worker resolves no connector itself: one resolution of the paged default;
    the connector reads the layout itself."""
    from lmkv.integrations.vllm.worker import WorkerSide

    calls: list[str] = []
    resolve = connector_module.resolve_connector_class

    def counting(config, kv_kind):  # type: ignore[no-untyped-def]
        calls.append(kv_kind)
        return resolve(config, kv_kind)

    import lmkv.integrations.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "resolve_connector_class", counting)
    config = load_config(env={}, overrides={"lmkv.chunk_size": 16,
                                            "lmkv.lookup.runtime_dir": str(tmp_path)})
    model = SimpleNamespace(model="m", get_head_size=lambda: 8, max_model_len=256)
    vllm_config = SimpleNamespace(model_config=model,
                                  parallel_config=SimpleNamespace(world_size=1, rank=0),
                                  kv_transfer_config=SimpleNamespace(engine_id="open-test"),
                                  cache_config=SimpleNamespace(block_size=16))
    worker = WorkerSide(config, vllm_config)
    try:
        worker.register({f"layer{i}": torch.zeros(4, 2, 16, 16) for i in range(2)})
        assert calls == ["paged"]
        assert isinstance(worker.engine, Engine)
        assert isinstance(worker.engine.connector, PagedConnector)
    finally:
        worker.close()
