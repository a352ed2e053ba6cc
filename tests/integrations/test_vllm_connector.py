"""The vLLM connector's vLLM-free parts (config, lazy offload); the connector itself
where vLLM is installed (the end-to-end check is tests/vllm/e2e_vllm.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lmkv.config import load_config
from lmkv.errors import ConfigError
from lmkv.integrations.vllm.config import config_from_extra, extra_config_overrides
from lmkv.integrations.vllm.lazy import LazyOffload
from lmkv.integrations.vllm.specs import StoreSpec


def test_lmcache_aliases_map_to_lmkv_keys(caplog: pytest.LogCaptureFixture) -> None:
    extra = {"lmcache.mp.lazy_offload": True, "lmcache.mp.lazy_offload_threshold": 3,
             "lmcache.mp.lazy_offload_select_count": 2, "lmcache.mp.lazy_offload_policy": "FIFO",
             "lmkv.chunk_size": 128, "shared_storage_path": "/elsewhere"}
    with caplog.at_level(logging.INFO, logger="lmkv"):
        config = config_from_extra(extra)
    assert (config.lazy_offload, config.lazy_offload_threshold,
            config.lazy_offload_select_count, config.chunk_size) == (True, 3, 2, 128)
    assert "mapped lmcache.mp.lazy_offload_threshold to lmkv.lazy_offload_threshold" \
        in caplog.text


def test_unknown_lmkv_key_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="no_such_key"):
        config_from_extra({"lmkv.no_such_key": 1})


def test_alias_and_its_target_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="both set"):
        extra_config_overrides({"lmcache.mp.lazy_offload": True, "lmkv.lazy_offload": True})


class FakePool:
    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, block_hash=None, ref_cnt=0)
                       for i in range(n)]

    def touch(self, blocks: list) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: list) -> None:
        for b in blocks:
            b.ref_cnt -= 1


def make_lazy(threshold: int = 1, world_size: int = 2) -> tuple[LazyOffload, FakePool]:
    config = load_config(overrides={"lmkv.lazy_offload": True,
                                    "lmkv.lazy_offload_threshold": threshold})
    pool = FakePool(8)
    lazy = LazyOffload(config, block_size=4, world_size=world_size, pool=pool)
    return lazy, pool


def store(pool: FakePool, lazy: LazyOffload, req: str, blocks: list[int], n_tokens: int) -> None:
    hashes = [f"{req}-{i}" for i in range(len(blocks))]
    for i, bid in enumerate(blocks):
        pool.blocks[bid].block_hash = hashes[i]
    lazy.add(StoreSpec(req, list(range(n_tokens)), blocks), hashes)


def test_lazy_offload_selects_verifies_protects_and_releases() -> None:
    lazy, pool = make_lazy(world_size=2)
    store(pool, lazy, "a", [0, 1], 8)
    assert lazy.select(10) == []  # not finished
    lazy.finished("a")
    assert lazy.select(0) == []  # an empty step never selects
    (spec,) = lazy.select(10)
    assert spec.req_id == "a" and spec.store_id
    assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]  # protected
    lazy.confirmed({spec.store_id: 1})
    assert pool.blocks[0].ref_cnt == 1  # one of two workers
    lazy.confirmed({spec.store_id: 1})
    assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [0, 0] and lazy.protected_stores == 0


def test_lazy_offload_skips_reused_blocks(caplog: pytest.LogCaptureFixture) -> None:
    lazy, pool = make_lazy()
    store(pool, lazy, "a", [0, 1], 8)
    lazy.finished("a")
    pool.blocks[1].block_hash = "someone-else"
    with caplog.at_level(logging.WARNING, logger="lmkv"):
        assert lazy.select(10) == []
    assert "block hashes mismatch for request a, skip it" in caplog.text
    assert lazy.skipped == 1 and pool.blocks[0].ref_cnt == 0


def test_steps_of_one_request_are_submitted_as_one_store() -> None:
    """Chunked prefill plans a request's store over several steps; finished, it is
    one store of its longest plan over all its blocks, protected once."""
    lazy, pool = make_lazy()
    hashes = ["r-0", "r-1", "r-2", "r-3"]
    for i, h in enumerate(hashes):
        pool.blocks[i].block_hash = h
    lazy.add(StoreSpec("r", list(range(8)), [0, 1]), hashes[:2])
    lazy.add(StoreSpec("r", list(range(16)), [0, 1, 2, 3]), hashes)
    lazy.finished("r")
    (spec,) = lazy.select(1)
    assert spec.token_ids == list(range(16)) and spec.block_ids == [0, 1, 2, 3]
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 1]


def test_unfinished_request_is_never_marked() -> None:
    lazy, _ = make_lazy()
    lazy.finished("never-stored")  # no pending store: nothing to mark
    assert len(lazy.policy) == 0


def test_connector_loads_where_vllm_is_installed() -> None:
    pytest.importorskip("vllm")
    from lmkv.integrations.vllm import LMKVConnector
    assert LMKVConnector.__name__ == "LMKVConnector"
