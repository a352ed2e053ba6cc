"""Block-granular hits: a prompt that leaves a stored one inside a chunk still
hits that chunk's leading whole blocks (aliases), and only its own KV."""

from __future__ import annotations

import random

import torch

from lmkv import KVSpec, load_config
from lmkv.engines.local import LocalEngine
from lmkv.keys.aliases import is_alias
from lmkv.keys.chunking import Identity
from lmkv.testing.engines import open_local_engine

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK, BLOCK = 32, 8


def make_engine(**overrides) -> LocalEngine:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK,
                                            "lmkv.block_size": BLOCK, **overrides})
    return open_local_engine(config, SPEC, model_name="block-test")


def hf_kv(tokens: list[int]):
    """KV that is a function of the prefix (as a real model's is): position i's values
    are seeded by tokens[: i + 1], so two prompts agree exactly on their common prefix."""
    layers = []
    for layer in range(2):
        k = torch.empty(1, 2, len(tokens), 16, dtype=torch.float16)
        v = torch.empty_like(k)
        for i in range(len(tokens)):
            gen = torch.Generator().manual_seed(hash((layer, tuple(tokens[:i + 1]))) % 2**31)
            k[0, :, i] = torch.randn(2, 16, generator=gen).half()
            v[0, :, i] = torch.randn(2, 16, generator=gen).half()
        layers.append((k, v))
    return layers


def same_kv(result, tokens: list[int], n: int) -> bool:
    want = hf_kv(tokens[:n])
    return all(torch.equal(rk[0], k[0]) and torch.equal(rv[0], v[0])
               for (k, v), (rk, rv) in zip(want, result.kv, strict=True))


def fresh(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def test_a_prompt_leaving_a_stored_one_inside_a_chunk_hits_its_whole_blocks() -> None:
    a = fresh(108, 1)
    with make_engine() as engine:
        assert engine.store(a, kv=hf_kv(a)) == 104  # 3 chunks and the 1-block tail
        assert engine.lookup(a) == 104
        for split in (33, 40, 47, 50, 63, 70, 95, 100):
            b = a[:split] + fresh(30, split)
            hit = split // BLOCK * BLOCK
            assert engine.lookup(b) == hit, split
            result = engine.retrieve(b)
            assert result.num_tokens == hit and same_kv(result, b, hit), split
            future = engine.lookup_and_prefetch(b, f"l{split}")
            assert future.result(10) == hit
            result = engine.retrieve(b[:hit], lookup_id=f"l{split}")
            assert result.num_tokens == hit and same_kv(result, b, hit), split


def test_another_identity_or_prefix_never_hits_the_blocks() -> None:
    a = fresh(64, 2)
    with make_engine() as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:48] + fresh(16, 3)
        assert engine.lookup(b) == 48
        assert engine.lookup(b, identity=Identity(salt="tenant")) == 0
        c = [a[0] + 1, *a[1:48], *fresh(16, 4)]  # differs in chunk 0
        assert engine.lookup(c) == 0
        d = [*a[:32], a[32] + 1, *a[33:48]]  # differs in the chunk's first block
        assert engine.lookup(d) == 32


def test_an_alias_whose_chunk_went_is_a_miss() -> None:
    a = fresh(64, 5)
    with make_engine() as engine:
        engine.store(a, kv=hf_kv(a))
        tier = engine.storage.tiers[0]
        full = engine.chunker.chunk(a).keys
        assert tier.remove(full[1])
        b = a[:48] + fresh(16, 6)
        assert engine.lookup(b) == 32
        result = engine.retrieve(b)
        assert result.num_tokens == 32 and same_kv(result, b, 32)


def test_aliases_are_tiny_entries_that_go_before_their_chunk() -> None:
    a = fresh(64, 7)
    with make_engine() as engine:
        engine.store(a, kv=hf_kv(a))
        tier = engine.storage.tiers[0]
        chunks = engine.chunker.chunk(a)
        assert len(tier) == 2 + 2 * 3  # two chunks, three aliases each
        alias = tier.get_blocking(chunks.partials[1][0])
        assert is_alias(alias) and alias.nbytes <= 256  # one arena block
        alias.ref_down()
        # The chunk is not a leaf while its aliases stay: they go first.
        leaves = tier.eviction_candidates()
        assert chunks.keys[1] not in leaves and chunks.partials[1][2] in leaves


def test_whole_chunk_keys_are_unchanged_by_blocks() -> None:
    a = fresh(64, 8)
    with make_engine() as blocks, make_engine(**{"lmkv.block_size": CHUNK}) as whole:
        assert blocks.chunker.chunk(a).keys == whole.chunker.chunk(a).keys
        assert whole.chunker.block_size is None and not whole.chunker.chunk(a).partials


def test_blocks_hit_from_disk_in_a_fresh_engine(tmp_path) -> None:
    """The fs tier keeps aliases like chunks: a fresh engine (another process, say)
    finds a chunk's leading blocks there, through every serializer."""
    a = fresh(108, 9)
    b = a[:50] + fresh(20, 10)
    for serializer in ("naive", "zstd", "int8"):
        root = tmp_path / serializer
        overrides = {"lmkv.tiers": [{"type": "fs", "options": {"url": str(root)}}],
                     "lmkv.serializer": {"type": serializer}}
        with make_engine(**overrides) as first:
            first.store(a, kv=hf_kv(a))
            assert first.storage.flush(30)
        with make_engine(**overrides) as second:
            assert second.lookup(b) == 48, serializer
            result = second.retrieve(b)
            assert result.num_tokens == 48
            if serializer != "int8":  # int8 is lossy for KV (never for aliases)
                assert same_kv(result, b, 48)


def test_a_tail_whose_chunk_went_is_not_counted() -> None:
    a = fresh(64, 11)
    with make_engine() as engine:
        engine.store(a, kv=hf_kv(a))
        assert engine.storage.tiers[0].remove(engine.chunker.chunk(a).keys[1])
        b = a[:48]  # its block-aligned tail is an alias of the removed chunk
        assert engine.lookup(b) == 32
        result = engine.retrieve(b)
        assert result.num_tokens == 32 and same_kv(result, b, 32)


def test_a_take_without_keys_never_hands_over_a_longer_chunk() -> None:
    """Only a retrieve that names its keys cuts a partial hit's chunk to its tokens;
    a take without keys gets the whole chunks before it."""
    a = fresh(64, 12)
    with make_engine() as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:40] + fresh(24, 13)
        assert engine.lookup_and_prefetch(b, "k").result(10) == 40
        objs = engine.storage.take_prefetched("k")
        assert [o.shape[2] for o in objs] == [32]
        for obj in objs:
            obj.ref_down()
