from __future__ import annotations

import re

import pytest
import torch

from lmkv import KVSpec, load_config
from lmkv.engines.local import LocalEngine
from lmkv.testing.engines import open_local_engine

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2


def make_engine(max_bytes: int = 1 << 22, **overrides) -> LocalEngine:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                            "lmkv.tiers.0.options.max_bytes": max_bytes,
                                            **overrides})
    return open_local_engine(config, SPEC, model_name="engine-test")


def hf_kv(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, total, 16, generator=gen).half(),
             torch.randn(1, 2, total, 16, generator=gen).half()) for _ in range(2)]


def test_store_lookup_retrieve() -> None:
    with make_engine() as engine:
        tokens = list(range(100))
        kv = hf_kv(100)
        assert engine.lookup(tokens) == 0
        assert engine.store(tokens, kv=kv) == 96  # 3 whole chunks
        assert engine.lookup(tokens) == 96
        assert engine.lookup(tokens[:70]) == 64
        assert engine.lookup([5, *tokens[1:]]) == 0
        result = engine.retrieve(tokens)
        assert result.num_tokens == 96
        for (k, v), (rk, rv) in zip(kv, result.kv, strict=True):
            assert torch.equal(rk[0], k[0, :, :96]) and torch.equal(rv[0], v[0, :, :96])


def test_store_skips_chunks_already_stored() -> None:
    with make_engine() as engine:
        tokens = list(range(128))
        assert engine.store(tokens[:64], kv=hf_kv(64)) == 64
        assert engine.store(tokens, kv=hf_kv(128)) == 64
        assert engine.stats()[0]["entries"] == 4


def test_save_partial_chunk() -> None:
    with make_engine(**{"lmkv.save_partial_chunk": True}) as engine:
        tokens = list(range(50))
        kv = hf_kv(50)
        assert engine.store(tokens, kv=kv) == 50
        assert engine.lookup(tokens) == 50
        result = engine.retrieve(tokens)
        assert result.num_tokens == 50
        assert torch.equal(result.kv[1][1][0], kv[1][1][0])


def test_paged_engine_round_trip_through_cpu_layout() -> None:
    config = load_config(env={}, overrides={
        "lmkv.chunk_size": CHUNK, "lmkv.gpu_connector": "paged"})
    block = 16
    caches = [torch.randn(8, 2, block, 32).half() for _ in range(2)]
    with open_local_engine(config, SPEC, model_name="paged", kv_kind="paged") as engine:
        tokens = list(range(64))
        assert engine.store(tokens, kv_caches=caches, block_ids=[3, 1, 6, 0]) == 64
        target = [torch.zeros_like(c) for c in caches]
        result = engine.retrieve(tokens, kv_caches=target, block_ids=[7, 2, 5, 4])
        assert result.num_tokens == 64 and result.kv is None
        for src, dst in zip(caches, target, strict=True):
            for a, b in zip([3, 1, 6, 0], [7, 2, 5, 4], strict=True):
                assert torch.equal(src[a], dst[b])


def test_store_under_memory_pressure_evicts_and_keeps_the_budget() -> None:
    budget = 8 * CHUNK_BYTES
    with make_engine(budget) as engine:
        tier = engine.storage.tiers[0]
        for i in range(20):
            tokens = [i * 1000 + t for t in range(128)]
            engine.store(tokens, kv=hf_kv(128, seed=i))
            assert tier.allocator.used_bytes <= budget
        assert tier.stats()["evictions"] >= 72
        last = [19 * 1000 + t for t in range(128)]
        assert engine.lookup(last) == 128
        assert tier.allocator.live_objects == tier.stats()["entries"]


def test_keys_of_different_ranks_do_not_mix() -> None:
    config = load_config(env={})
    a = open_local_engine(config, SPEC, model_name="m", worker_id=0)
    b = open_local_engine(config, SPEC, model_name="m", worker_id=1)
    b.storage = a.storage  # one shared tier
    tokens = list(range(512))
    a.store(tokens, kv=hf_kv(512))
    assert a.lookup(tokens) == 512 and b.lookup(tokens) == 0
    a.close()


def test_invalid_tokens_raise_value_error() -> None:
    with make_engine() as engine, pytest.raises(ValueError):
        engine.lookup([-1] * 64)


def test_a_store_never_evicts_the_prefix_it_builds_on() -> None:
    with make_engine(4 * CHUNK_BYTES) as engine:
        tokens = list(range(5 * CHUNK))
        assert engine.store(tokens[:2 * CHUNK], kv=hf_kv(2 * CHUNK)) == 2 * CHUNK
        engine.store(tokens, kv=hf_kv(5 * CHUNK))
        assert engine.lookup(tokens) == 4 * CHUNK  # prefix kept; what fits after it stored
        tier = engine.storage.tiers[0]
        assert all(pins == 0 for _, pins in tier.entry_refs())


@pytest.mark.parametrize("bad_kv,message", [
    (lambda kv: kv[:1], "KV has 1 layers; this engine stores 2"),
    (lambda kv: [(k[:, :1], v[:, :1]) for k, v in kv], "expected [batch, 2, seq, 16]"),
    (lambda kv: [(k.float(), v.float()) for k, v in kv], "KV dtype torch.float32"),
    (lambda kv: [(k[:, :, :10], v[:, :, :10]) for k, v in kv], "KV holds 10 tokens; 64 needed"),
])
def test_mismatched_kv_is_refused_and_nothing_is_stored(bad_kv, message: str) -> None:
    with make_engine() as engine:
        tokens = list(range(64))
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.store(tokens, kv=bad_kv(hf_kv(64)))
        assert engine.lookup(tokens) == 0
        assert engine.storage.tiers[0].allocator.live_objects == 0


def test_mismatched_paged_caches_are_refused() -> None:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                            "lmkv.gpu_connector": "paged"})
    with open_local_engine(config, SPEC, model_name="paged", kv_kind="paged") as engine:
        caches = [torch.randn(2, 8, 16, 2, 16).half()]  # one layer instead of two
        with pytest.raises(ValueError, match="1 KV caches; this engine stores 2"):
            engine.store(list(range(32)), kv_caches=caches, block_ids=[0, 1])
        caches = [torch.randn(2, 8, 16, 2, 16).half() for _ in range(2)]
        with pytest.raises(ValueError, match="1 blocks of 16 tokens cannot hold 32"):
            engine.store(list(range(32)), kv_caches=caches, block_ids=[0])


def test_prefetched_chunks_are_consumed_by_retrieve() -> None:
    with make_engine() as engine:
        tokens = list(range(96))
        kv = hf_kv(96)
        engine.store(tokens, kv=kv)
        assert engine.lookup_and_prefetch(tokens, "req-1").result(5) == 96
        result = engine.retrieve(tokens, lookup_id="req-1")
        assert result.num_tokens == 96
        assert torch.equal(result.kv[0][0][0], kv[0][0][0, :, :96])
        assert engine.lookup_and_prefetch(tokens, "req-2").result(5) == 96
        engine.release_lookup("req-2")
        tier = engine.storage.tiers[0]
        assert all(refs == (1, 0) for refs in tier.entry_refs())


def test_prefetch_by_hashes_computed_elsewhere() -> None:
    from lmkv.keys.chunking import prefix_hashes

    with make_engine() as engine:
        tokens = list(range(100))
        engine.store(tokens, kv=hf_kv(100))
        hashes = prefix_hashes(tokens, CHUNK)
        ends = [CHUNK * (i + 1) for i in range(len(hashes))]
        assert engine.lookup_and_prefetch_hashes("h", hashes, ends).result(5) == 96
        assert engine.retrieve(tokens, lookup_id="h").num_tokens == 96


def test_paged_retrieve_streams_across_tiers() -> None:
    config = load_config(env={}, overrides={
        "lmkv.chunk_size": 16, "lmkv.gpu_connector": "paged",
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "1MiB"}},
                       {"type": "cpu", "options": {"max_bytes": "2MiB"}}]})
    caches = [torch.randn(8, 2, 16, 32).half() for _ in range(2)]
    with open_local_engine(config, SPEC, model_name="paged", kv_kind="paged") as engine:
        tokens = list(range(64))
        engine.store(tokens, kv_caches=caches, block_ids=[0, 1, 2, 3])
        assert engine.storage.flush(5)
        upper = engine.storage.tiers[0]
        for k in engine.chunker.chunk(tokens).keys[2:]:
            assert upper.remove(k)  # the last two chunks now live only in the lower tier
        target = [torch.zeros_like(c) for c in caches]
        result = engine.retrieve(tokens, kv_caches=target, block_ids=[4, 5, 6, 7])
        assert result.num_tokens == 64
        for src, dst in zip(caches, target, strict=True):
            assert torch.equal(src[:4], dst[4:])
        assert all(upper.contains(k) for k in engine.chunker.chunk(tokens).keys)  # promoted


def test_a_lookup_id_reused_for_another_prompt_never_yields_its_kv() -> None:
    with make_engine() as engine:
        a, b = list(range(64)), list(range(1000, 1064))
        kv_a, kv_b = hf_kv(64, seed=1), hf_kv(64, seed=2)
        engine.store(a, kv=kv_a)
        engine.store(b, kv=kv_b)
        assert engine.lookup_and_prefetch(a, "x").result(5) == 64
        result = engine.retrieve(b, lookup_id="x")  # prefetched for a, asked for b
        assert result.num_tokens == 64
        assert torch.equal(result.kv[0][0][0], kv_b[0][0][0])
        tier = engine.storage.tiers[0]
        assert all(refs == (1, 0) for refs in tier.entry_refs())


def test_a_retrieve_reuses_its_lookup_s_chunks_only_for_the_same_tokens_and_identity(
        monkeypatch) -> None:
    """The chunks a lookup made are reused by the retrieve under its id when the
    tokens (byte for byte) and the identity are the same; any other retrieve
    makes its own, so a reused id, a changed token list or another tenant never
    gets the lookup's keys."""
    from lmkv.engines import local
    from lmkv.keys.chunking import Identity, MMInput

    with make_engine() as engine:
        made = []
        chunk = engine.chunker.chunk
        monkeypatch.setattr(engine.chunker, "chunk",
                            lambda *a, **k: made.append(1) or chunk(*a, **k))
        tokens = list(range(64))
        kv, kv_salted = hf_kv(64, seed=1), hf_kv(64, seed=2)
        tenant = Identity(salt="tenant-b")
        engine.store(tokens, kv=kv)
        engine.store(tokens, kv=kv_salted, identity=tenant)
        made.clear()
        assert engine.lookup_and_prefetch(tokens, "same").result(5) == 64
        result = engine.retrieve(list(tokens), lookup_id="same")
        assert len(made) == 1 and torch.equal(result.kv[0][0][0], kv[0][0][0])

        # another identity under the lookup's id: its own keys, its own KV
        assert engine.lookup_and_prefetch(tokens, "other").result(5) == 64
        result = engine.retrieve(tokens, lookup_id="other", identity=tenant)
        assert torch.equal(result.kv[0][0][0], kv_salted[0][0][0])

        # identities equal to Python but hashed apart (an offset as int, then float)
        as_int = Identity(mm=(MMInput("img", 8, 4),))
        as_float = Identity(mm=(MMInput("img", 8.0, 4),))  # type: ignore[arg-type]
        assert as_int == as_float
        engine.lookup_and_prefetch(tokens, "mm", identity=as_int).result(5)
        made.clear()
        engine.retrieve(tokens, lookup_id="mm", identity=as_float)
        assert len(made) == 1

        # the list changed in place since the lookup: made again, of what it holds now
        changed = list(tokens)
        assert engine.lookup_and_prefetch(changed, "changed").result(5) == 64
        changed[40] = 99_999
        assert engine.retrieve(changed, lookup_id="changed").num_tokens == 32
        tier = engine.storage.tiers[0]
        assert all(refs == (1, 0) for refs in tier.entry_refs())

        # lookups never retrieved are not kept without end
        for i in range(3 * local.LOOKUPS_KEPT):
            engine.lookup_and_prefetch(tokens, f"dropped-{i}").result(5)
            engine.release_lookup(f"dropped-{i}") if i % 2 else None
        assert len(engine._looked_up) <= local.LOOKUPS_KEPT


def test_prefetch_after_close_is_a_miss() -> None:
    engine = make_engine()
    engine.close()
    assert engine.lookup_and_prefetch(list(range(64)), "late").result(5) == 0


def test_mla_kv_is_named_once_for_the_ranks_that_replicate_it() -> None:
    """MLA's latent is the same on every tensor-parallel rank (``KVSpec.replicas``):
    one key for those ranks, so each chunk is stored once; pipeline stages
    (ranks ``replicas`` apart) still differ, as do engines without replicas."""
    from lmkv.contracts.connector import GPUConnector
    from lmkv.engines.keys import engine_chunker

    config = load_config(env={})
    mla = KVSpec(num_layers=2, num_kv_heads=1, head_dim=24, dtype=torch.bfloat16,
                 kv_planes=1, replicas=2)

    def meta(spec: KVSpec, rank: int):
        return engine_chunker(config, spec, "m", GPUConnector, 4, rank).meta

    assert meta(mla, 0) == meta(mla, 1) != meta(mla, 2) == meta(mla, 3)
    assert (meta(mla, 3).world_size, meta(mla, 3).worker_id) == (2, 1)
    assert meta(mla, 0).kv_layout == "l1thd"
    assert meta(SPEC, 0) != meta(SPEC, 1) and meta(SPEC, 0).kv_layout == "l2thd"


def test_heads_outer_chunks_are_named_apart_and_need_a_connector_that_moves_them() -> None:
    """A heads-outer spec's chunks (``lht2d``) never share a key with canonical
    ones of the same geometry; a connector that moves canonical chunks cannot
    serve such a spec (its bytes would be named as the other order's)."""
    from dataclasses import replace

    from lmkv.contracts.connector import ConnectorContext, GPUConnector
    from lmkv.engines.keys import engine_chunker
    from lmkv_backends.connectors.paged import PagedConnector

    config = load_config(env={})
    outer = replace(SPEC, heads_outer=True)
    paged = PagedConnector(None, ConnectorContext(outer))
    meta = engine_chunker(config, outer, "m", paged, 1, 0).meta
    assert meta.kv_layout == "lht2d"
    assert meta != engine_chunker(config, SPEC, "m", GPUConnector, 1, 0).meta
    with pytest.raises(ValueError, match="moves l2thd chunks; this engine's KV spec holds "
                                         "lht2d chunks"):
        engine_chunker(config, outer, "m", GPUConnector, 1, 0)
