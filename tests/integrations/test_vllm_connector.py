"""The vLLM connector's vLLM-free parts (config, lazy offload); the connector itself
where vLLM is installed (the end-to-end check is tests/vllm/e2e_vllm.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.integrations.vllm.config import config_from_extra, extra_config_overrides
from lmkv.integrations.vllm.lazy import LazyOffload
from lmkv.integrations.vllm.specs import BlockNames, StoreSpec


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


def test_misspelt_lmkv_key_names_the_allowed_keys() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'chunk_size'.*allowed: .*tiers"):
        config_from_extra({"lmkv.chunk_sise": 128})


def test_lmcache_keys_with_an_lmkv_key_are_mapped() -> None:
    config = config_from_extra({"lmcache.chunk_size": 128, "lmcache.enable_async_loading":
                                "true", "lmcache.lookup_timeout_ms": 500,
                                "lmcache.save_unfull_chunk": True,
                                "lmcache.use_layerwise": True})
    assert (config.chunk_size, config.async_load, config.lookup.timeout_ms,
            config.layerwise) == (128, True, 500, True)


def test_lmcache_features_left_off_are_accepted() -> None:
    config = config_from_extra({"lmcache.enable_blending": False, "lmcache.pd_role": None})
    assert config.chunk_size == load_config(env={}).chunk_size


def one_line_error(extra: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_extra(extra)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_lmcache_storage_keys_are_an_error_naming_the_tiers_to_set() -> None:
    message = one_line_error({"lmcache.max_local_cpu_size": 8,
                              "lmcache.local_disk": "/data/kv",
                              "lmcache.max_local_disk_size": 100})
    assert "'lmcache.max_local_cpu_size'" in message and "'lmcache.local_disk'" in message
    assert ('"lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "8GiB"}}, '
            '{"type": "fs", "options": {"url": "/data/kv", "max_bytes": "100GiB"}}]') \
        in message


@pytest.mark.parametrize(("key", "value", "why"), [
    ("lmcache.enable_blending", True, "CacheBlend"),
    ("lmcache.pd_role", "sender", "NixlConnector"),
    ("lmcache.remote_url", "lm://host:65432", "lmkv server"),
    ("lmcache.mp.host", "tcp://localhost", "server.address"),
    ("lmcache.mp.mq_timeout", 60, "server.timeout_ms"),
    ("lmcache.no_such_option", 1, "not an LMCache option"),
])
def test_lmcache_keys_without_an_equivalent_are_one_line_saying_why(
        key: str, value: object, why: str) -> None:
    message = one_line_error({key: value})
    assert repr(key) in message and why in message


def test_lmcache_key_of_the_wrong_type_names_it() -> None:
    message = one_line_error({"lmcache.chunk_size": "lots"})
    assert "'lmcache.chunk_size' = 'lots'" in message and "positive integer" in message


def test_bare_lmkv_key_is_an_error_naming_the_prefixed_one() -> None:
    assert "'lmkv.chunk_size'" in one_line_error({"chunk_size": 128})


def test_every_bad_key_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_extra({"lmcache.enable_blending": True, "lmcache.enable_p2p": True})
    assert len(str(info.value).splitlines()) == 2


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
    names = BlockNames([10, 11, 12, 13])  # vLLM's names of its blocks (KV events)
    lazy.add(StoreSpec("r", list(range(16)), [0, 1, 2, 3], blocks=names), hashes)
    lazy.finished("r")
    (spec,) = lazy.select(1)
    assert spec.token_ids == list(range(16)) and spec.block_ids == [0, 1, 2, 3]
    assert spec.blocks is names and spec.store_id is not None
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 1]


class WatchingPool(FakePool):
    """FakePool with vLLM's reuse watchers (``BlockPool.unpin_blocks``): ``hand_out``
    is ``get_new_blocks`` for given blocks: it calls a block's watcher while the
    block's hash is still cached, then drops the hash, as vLLM does; ``reset`` is
    ``reset_prefix_cache``: the cache map goes first, then the watchers fire."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.watchers: dict[int, object] = {}
        self.resetting = False
        self.cached_block_hash_to_block = SimpleNamespace(contain=lambda h, bid: (
            not self.resetting and self.blocks[bid].block_hash == h))

    def reset(self) -> None:
        self.resetting = True
        for i in list(self.watchers):
            self.watchers.pop(i)(self.blocks[i])
        for block in self.blocks:
            block.block_hash = None
        self.resetting = False

    def unpin_blocks(self, blocks: list, on_reuse) -> None:  # type: ignore[no-untyped-def]
        for b in blocks:
            assert b.ref_cnt > 0
            b.ref_cnt -= 1
            self.watchers[b.block_id] = on_reuse

    def hand_out(self, *ids: int) -> None:
        for i in ids:
            block = self.blocks[i]
            assert block.ref_cnt == 0, "handing out a block in use"
            watcher = self.watchers.pop(i, None)
            if watcher is not None:
                watcher(block)
            block.block_hash = None
            block.ref_cnt = 1


def finish(pool: FakePool, lazy: LazyOffload, req: str, blocks: list[int]) -> None:
    """vLLM's order: request_finished (``lazy.finished``) while the request holds
    its blocks, then the blocks are freed."""
    for b in blocks:
        pool.blocks[b].ref_cnt += 1  # the request's own reference
    lazy.finished(req, blocks)
    pool.free_blocks([pool.blocks[b] for b in blocks])


def make_watching_lazy(threshold: int = 5) -> tuple[LazyOffload, WatchingPool]:
    config = load_config(overrides={"lmkv.lazy_offload": True,
                                    "lmkv.lazy_offload_threshold": threshold})
    pool = WatchingPool(8)
    return LazyOffload(config, block_size=4, world_size=1, pool=pool), pool


def test_blocks_handed_out_are_rescued_in_that_step() -> None:
    """Below the policy's threshold nothing is selected; vLLM hands one of the
    finished request's blocks to another request: that step's plan stores the
    whole request before the step's forward, and the policy's item is dropped."""
    lazy, pool = make_watching_lazy(threshold=5)
    store(pool, lazy, "a", [0, 1, 2], 12)
    finish(pool, lazy, "a", [0, 1, 2])
    assert [b.ref_cnt for b in pool.blocks[:3]] == [0, 0, 0]  # freed: nothing held back
    assert lazy.select(10) == []  # below the threshold, nothing handed out
    pool.hand_out(2)
    (spec,) = lazy.select(10)
    assert spec.before_compute and spec.store_id is None
    assert spec.token_ids == list(range(12)) and spec.block_ids == [0, 1, 2]
    assert lazy.rescued == 1 and lazy.select(10) == []  # once
    assert [b.ref_cnt for b in pool.blocks[:2]] == [0, 0]  # nothing protected
    for block, req in enumerate("bcde", start=4):  # the policy's item for "a" comes
        store(pool, lazy, req, [block], 4)        # up later: dropped, not stored twice
        finish(pool, lazy, req, [block])
    specs = lazy.select(10) + lazy.select(10) + lazy.select(10)
    assert "a" not in {s.req_id for s in specs} and not any(s.before_compute for s in specs)
    assert lazy.skipped == 0  # dropped as stored, not verified and skipped


def test_a_reuse_counts_only_in_its_own_step() -> None:
    """Block 1 is handed out in one step ("a" rescued then). Its next owner "y"
    finishes later with other KV in it: nothing is rescued for "y" until the pool
    hands its blocks out again, and its store comes from the policy."""
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "a", [0, 1], 8)
    finish(pool, lazy, "a", [0, 1])
    pool.hand_out(1)
    (spec,) = lazy.select(0)
    assert spec.req_id == "a" and spec.before_compute
    pool.free_blocks([pool.blocks[1]])  # its new owner held it for a while
    store(pool, lazy, "y", [1], 4)
    finish(pool, lazy, "y", [1])
    (spec,) = lazy.select(1)
    assert spec.req_id == "y" and not spec.before_compute and lazy.skipped == 0


def test_a_rescue_stops_at_the_first_block_that_lost_its_kv() -> None:
    """A block reused in an earlier step (its KV overwritten since), a block whose
    hash changed unseen, and a block the step zeroes or copies into before
    start_load_kv all end the rescue there; nothing past them is stored."""
    lazy, pool = make_watching_lazy()
    store(pool, lazy, "a", [0, 1, 2, 3], 16)
    finish(pool, lazy, "a", [0, 1, 2, 3])
    pool.hand_out(3)
    (spec,) = lazy.select(1, overwritten=lambda: {1})
    assert spec.token_ids == list(range(4)) and spec.block_ids == [0]

    store(pool, lazy, "b", [4, 5, 6], 12)
    finish(pool, lazy, "b", [4, 5, 6])
    pool.blocks[5].block_hash = "changed while we did not watch"
    pool.hand_out(6)
    (spec,) = lazy.select(1)
    assert spec.block_ids == [4] and spec.token_ids == list(range(4))

    store(pool, lazy, "d", [4, 5], 8)  # (4 and 5 hold "d"'s KV now)
    finish(pool, lazy, "d", [4, 5])
    pool.blocks[5].block_hash = "someone else's"  # unseen, and then handed out
    pool.hand_out(5)
    (spec,) = lazy.select(1)
    assert spec.req_id == "d" and spec.block_ids == [4]

    store(pool, lazy, "c", [7], 4)
    finish(pool, lazy, "c", [7])
    pool.hand_out(7)
    assert lazy.select(1, overwritten=lambda: {7}) == [] and lazy.skipped == 1


def test_a_prefix_cache_reset_is_never_taken_for_a_reuse() -> None:
    """vLLM's reset_prefix_cache (sleep, weight updates) fires every watcher; the KV
    may be gone (sleep frees it) or stale (new weights): nothing is rescued, then
    or when the blocks are handed out later, and the policy finds the hashes gone."""
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "a", [0, 1], 8)
    finish(pool, lazy, "a", [0, 1])
    pool.reset()
    assert lazy.select(0) == []
    pool.hand_out(0, 1)
    assert lazy.select(1) == [] and lazy.rescued == 0 and lazy.skipped == 1


def test_only_blocks_watched_since_the_finish_are_rescued() -> None:
    """A block the request no longer held at its finish is not watched: it may be
    handed out and written unseen, and vLLM hashes a block when it allocates it
    (before the forward writes it), so a matching hash proves nothing. The rescue
    stops there even though later blocks look intact."""
    lazy, pool = make_watching_lazy()
    store(pool, lazy, "a", [0, 1, 2], 12)
    for b in (0, 2):
        pool.blocks[b].ref_cnt += 1  # block 1 was already let go (not held at finish)
    lazy.finished("a", [0, 1, 2])
    pool.free_blocks([pool.blocks[0], pool.blocks[2]])
    pool.hand_out(0)
    (spec,) = lazy.select(1)
    assert spec.block_ids == [0] and spec.token_ids == list(range(4))


def test_a_resumed_request_is_verified_against_its_own_block_table() -> None:
    """Preempted and resumed on other blocks, a request's later, shorter plan
    replaces the old one (whose blocks were freed at the preemption); hashes are
    compared by position in the plan they belong to, and the plan is cut to the
    blocks vLLM says the request holds at its finish."""
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "r", [0, 1, 3], 12)  # first run: blocks 0, 1, 3
    # Preempted, resumed on blocks 2, 0: block 0 now holds position 1 ("r-1").
    pool.blocks[2].block_hash, pool.blocks[0].block_hash = "r-0", "r-1"
    pool.blocks[1].block_hash = "r-1"  # (block 1 still looks like position 1)
    lazy.add(StoreSpec("r", list(range(8)), [2, 0]), ["r-0", "r-1"])
    lazy.finished("r")  # (no block table given: no cut at the finish)
    (spec,) = lazy.select(1)
    assert spec.block_ids == [2, 0] and spec.token_ids == list(range(8))

    store(pool, lazy, "s", [4, 5, 6], 12)
    finish(pool, lazy, "s", [4, 5])  # vLLM holds two of the plan's blocks only
    (spec,) = lazy.select(1)
    assert spec.block_ids == [4, 5] and spec.token_ids == list(range(8))


def test_an_empty_step_rescues_but_never_pops_the_policy() -> None:
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "a", [0], 4)
    finish(pool, lazy, "a", [0])
    pool.hand_out(0)
    (spec,) = lazy.select(0)
    assert spec.before_compute
    store(pool, lazy, "b", [1], 4)
    finish(pool, lazy, "b", [1])
    assert lazy.select(0) == []  # the policy is asked only on a step with tokens
    (spec,) = lazy.select(1)
    assert spec.req_id == "b" and not spec.before_compute


def test_a_request_stored_by_the_policy_is_not_rescued_after() -> None:
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "a", [0, 1], 8)
    finish(pool, lazy, "a", [0, 1])
    (spec,) = lazy.select(1)
    lazy.confirmed({spec.store_id: 1})  # protected blocks released
    pool.hand_out(0, 1)  # the pool still holds the (stale) watchers
    assert lazy.select(1) == [] and lazy.rescued == 0


def test_a_request_id_used_again_never_breaks_the_finish(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """vLLM calls request_finished from its scheduler: a policy that no longer holds
    the id (an id used again after its item went out) is a warning, not a raise."""
    lazy, pool = make_watching_lazy(threshold=1)
    store(pool, lazy, "a", [0], 4)
    finish(pool, lazy, "a", [0])
    pool.hand_out(0)
    (spec,) = lazy.select(0)  # rescued; the policy still holds a's finished item
    store(pool, lazy, "a", [1], 4)  # the same id again: merged into that item
    (spec,) = lazy.select(1)  # the item goes out: the new request's plan is stored
    assert spec.block_ids == [1] and not spec.before_compute
    with caplog.at_level(logging.WARNING, logger="lmkv"):
        finish(pool, lazy, "a", [1])  # FIFO no longer holds "a": ValueError inside
    assert "request 'a' has no pending store" in caplog.text


def test_a_pool_without_reuse_watchers_keeps_the_old_behaviour() -> None:
    lazy, pool = make_lazy(threshold=1)  # FakePool: no unpin_blocks
    store(pool, lazy, "a", [0, 1], 8)
    finish(pool, lazy, "a", [0, 1])
    pool.blocks[0].block_hash = None  # reused
    assert lazy.select(1) == [] and lazy.skipped == 1 and lazy.rescued == 0


def test_unfinished_request_is_never_marked() -> None:
    lazy, _ = make_lazy()
    lazy.finished("never-stored")  # no pending store: nothing to mark
    assert len(lazy.policy) == 0


@pytest.mark.vllm
def test_connector_loads_where_vllm_is_installed() -> None:
    pytest.importorskip("vllm")
    from lmkv.integrations.vllm import LMKVConnector
    assert LMKVConnector.__name__ == "LMKVConnector"


# -- the scheduler side against a real worker engine over the lookup channel ----------

def _scheduler_and_worker(tmp_path, **keys):  # type: ignore[no-untyped-def]
    import torch

    from lmkv.contracts.connector import ConnectorContext, KVSpec
    from lmkv.engines.local import LocalEngine
    from lmkv.integrations.vllm.scheduler import SchedulerSide
    from lmkv.lookup.responder import LookupResponder
    from lmkv.lookup.sockets import LookupEndpoints
    from lmkv.storage.manager import StorageManager
    from lmkv_backends.connectors.paged import PagedConnector

    config = load_config(overrides={"lmkv.chunk_size": 16,
                                    "lmkv.lookup.runtime_dir": str(tmp_path), **keys})
    spec = KVSpec(2, 2, 8, torch.float32)
    engine = LocalEngine(config, spec, model_name="m",
                         connector=PagedConnector(None, ConnectorContext(spec)),
                         storage=StorageManager.from_config(config))
    server = LookupResponder.for_rank(
        engine, LookupEndpoints.from_config(config.lookup, "e2", 1), 0)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="e2"),
                                  parallel_config=SimpleNamespace(world_size=1),
                                  model_config=SimpleNamespace(max_model_len=2048),
                                  cache_config=SimpleNamespace(block_size=16))
    caches = [torch.randn(8, 2, 16, 16) for _ in range(2)]  # blocks of 16 tokens
    return SchedulerSide(config, vllm_config), engine, server, caches


def _no_steps(new=()):  # type: ignore[no-untyped-def]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                             num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0)


def _ask(sched, request, computed: int) -> int:  # type: ignore[no-untyped-def]
    import time
    deadline = time.monotonic() + 15
    while (n := sched.num_new_matched_tokens(request, computed)) is None:
        assert time.monotonic() < deadline, "no lookup answer"
        sched.build_meta(_no_steps())  # a step ends: a fresh wait budget
    return n


def test_async_load_is_planned_at_allocation_and_not_stored_again(tmp_path) -> None:
    sched, engine, server, caches = _scheduler_and_worker(tmp_path, **{"lmkv.async_load": True})
    try:
        prompt = list(range(100, 150))  # 3 whole chunks of 16 + 2 tokens
        engine.store(prompt[:48], kv_caches=caches, block_ids=[0, 1, 2, 3])
        request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, block_hashes=[])
        assert _ask(sched, request, 16) == 32  # vLLM had the first chunk itself
        sched.after_alloc(request, [5, 6, 7, 4], 32)
        (load,) = sched.build_meta(_no_steps()).loads
        assert (load.async_load, load.token_ids, load.block_ids, load.skip_tokens) == \
            (True, prompt[:48], [5, 6, 7, 4], 16)
        assert sched.build_meta(_no_steps()).loads == []  # planned once
        # Loaded, vLLM schedules it: the loaded chunks are not planned as a store.
        new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=([5, 6, 7, 4],),
                              num_computed_tokens=48)
        out = _no_steps([new])
        out.num_scheduled_tokens = {"r": 2}
        meta = sched.build_meta(out)
        assert meta.loads == [] and meta.stores == []
    finally:
        sched.close()
        server.close()
        engine.close()


def test_synchronous_load_is_planned_when_scheduled(tmp_path) -> None:
    sched, engine, server, caches = _scheduler_and_worker(tmp_path)
    try:
        prompt = list(range(200, 240))  # 2 whole chunks + 8 tokens
        engine.store(prompt[:32], kv_caches=caches, block_ids=[0, 1])
        request = SimpleNamespace(request_id="s", prompt_token_ids=prompt, block_hashes=[])
        assert _ask(sched, request, 0) == 32
        sched.after_alloc(request, [3, 2, 1], 32)
        assert sched.build_meta(_no_steps()).loads == []  # nothing until it is scheduled
        new = SimpleNamespace(req_id="s", prompt_token_ids=prompt, block_ids=([3, 2, 1],),
                              num_computed_tokens=32)
        out = _no_steps([new])
        out.num_scheduled_tokens = {"s": 8}
        (load,) = sched.build_meta(out).loads
        assert (load.async_load, load.token_ids, load.block_ids, load.skip_tokens) == \
            (False, prompt[:32], [3, 2, 1], 0)
        sched.finished(request)  # the load took the prefetch: nothing to release
        assert sched.client.counters.cancels == 0
    finally:
        sched.close()
        server.close()
        engine.close()


def test_a_hit_vllm_does_not_load_is_released_once(tmp_path) -> None:
    sched, engine, server, caches = _scheduler_and_worker(tmp_path)
    try:
        prompt = list(range(300, 340))
        engine.store(prompt[:32], kv_caches=caches, block_ids=[0, 1])
        request = SimpleNamespace(request_id="u", prompt_token_ids=prompt, block_hashes=[])
        assert _ask(sched, request, 0) == 32
        sched.after_alloc(request, [], 0)  # vLLM loads nothing (e.g. no room)
        sched.finished(request)
        assert sched.client.counters.cancels == 1
    finally:
        sched.close()
        server.close()
        engine.close()


def test_requests_hit_only_their_own_identity_and_plans_carry_it(tmp_path) -> None:
    """The scheduler looks up under the request's identity (its cache_salt here) and
    hands it to the workers with the load plan (vLLM-free: requests are plain objects;
    tests/vllm/test_identity_vllm.py uses vLLM's own)."""
    from lmkv.keys.chunking import Identity

    sched, engine, server, caches = _scheduler_and_worker(tmp_path)
    try:
        prompt = list(range(400, 440))
        engine.store(prompt[:32], identity=Identity(salt="a"), kv_caches=caches,
                     block_ids=[0, 1])

        def request(req_id: str, salt: str | None):  # type: ignore[no-untyped-def]
            return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, block_hashes=[],
                                   cache_salt=salt, lora_request=None, mm_features=None,
                                   prompt_embeds=None)

        assert _ask(sched, request("b", "b"), 0) == 0
        assert _ask(sched, request("none", None), 0) == 0
        mine = request("a", "a")
        assert _ask(sched, mine, 0) == 32
        sched.after_alloc(mine, [3, 2, 1], 32)
        new = SimpleNamespace(req_id="a", prompt_token_ids=prompt, block_ids=([3, 2, 1],),
                              num_computed_tokens=32)
        out = _no_steps([new])
        out.num_scheduled_tokens = {"a": 8}
        (load,) = sched.build_meta(out).loads
        assert load.identity == Identity(salt="a")
    finally:
        sched.close()
        server.close()
        engine.close()


def test_a_prompt_leaving_a_stored_one_mid_chunk_loads_its_whole_blocks(tmp_path) -> None:
    """Chunks of 32 tokens, vLLM blocks of 16: the scheduler asks for, and the
    workers load, every whole block a stored chunk shares with the prompt."""
    import torch

    sched, engine, server, caches = _scheduler_and_worker(
        tmp_path, **{"lmkv.chunk_size": 32, "lmkv.block_size": 16})
    try:
        stored = list(range(400, 464))  # 2 whole chunks
        engine.store(stored, kv_caches=caches, block_ids=[0, 1, 2, 3])
        want = [c[[0, 1, 2]].clone() for c in caches]  # its first 3 blocks (48 tokens)
        prompt = [*stored[:52], *range(9000, 9020)]  # leaves chunk 1 inside its 2nd block
        request = SimpleNamespace(request_id="b", prompt_token_ids=prompt, block_hashes=[])
        assert _ask(sched, request, 0) == 48  # chunk 0 and chunk 1's first block
        sched.after_alloc(request, [7, 6, 5, 4, 3], 48)
        new = SimpleNamespace(req_id="b", prompt_token_ids=prompt,
                              block_ids=([7, 6, 5, 4, 3],), num_computed_tokens=48)
        out = _no_steps([new])
        out.num_scheduled_tokens = {"b": len(prompt) - 48}
        (load,) = sched.build_meta(out).loads
        assert (load.token_ids, load.skip_tokens) == (prompt[:48], 0)
        for cache in caches:
            cache[[7, 6, 5]] = 0
        got = engine.retrieve(load.token_ids, lookup_id="b", kv_caches=caches,
                              block_ids=load.block_ids)
        assert got.num_tokens == 48
        for cache, expected in zip(caches, want, strict=True):
            assert torch.equal(cache[[7, 6, 5]], expected)
    finally:
        sched.close()
        server.close()
        engine.close()


def test_held_blocks_keep_an_idle_engine_stepping_until_they_go_back(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """``awaits_release`` (the connector's ``has_pending_push_work``): true while lazy
    stores' protected blocks wait for the workers, false once they are confirmed;
    false (with one warning) once the stores have made no progress for the bound,
    and true again when they do."""
    from lmkv.integrations.vllm.lazy import RELEASE_STEPPING_S
    sched, engine, server, _ = _scheduler_and_worker(tmp_path)
    now = [1000.0]
    try:
        lazy, pool = make_lazy(world_size=1)
        lazy._clock = lambda: now[0]
        sched.lazy = lazy
        assert not sched.awaits_release()
        store(pool, lazy, "a", [0, 1], 8)
        lazy.finished("a")
        (first,) = lazy.select(10)
        assert sched.awaits_release()
        now[0] += RELEASE_STEPPING_S - 1
        assert sched.awaits_release()  # within the bound
        store(pool, lazy, "b", [2, 3], 8)
        lazy.finished("b")
        (second,) = lazy.select(10)  # progress: the bound starts again
        assert sched.awaits_release()  # (vLLM's loop asks at every turn)
        now[0] += RELEASE_STEPPING_S - 1
        assert sched.awaits_release()
        sched.confirmed({first.store_id: 1})  # progress again
        assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [0, 0]
        assert sched.awaits_release()
        now[0] += RELEASE_STEPPING_S - 1
        assert sched.awaits_release()
        with caplog.at_level(logging.WARNING, logger="lmkv"):
            now[0] += 2  # no progress for the bound: the stepping stops, said once
            assert not sched.awaits_release()
            assert not sched.awaits_release()
        assert caplog.text.count("unconfirmed for") == 1
        assert [pool.blocks[i].ref_cnt for i in (2, 3)] == [1, 1]  # still protected
        sched.confirmed({second.store_id: 1})  # a late confirmation still releases
        assert not sched.awaits_release()
        assert [pool.blocks[i].ref_cnt for i in (2, 3)] == [0, 0]
    finally:
        sched.close()
        server.close()
        engine.close()
