"""The router's index: prefixes matched per instance and cache, from KV events;
bounded, and forgetting instances that went silent."""

from __future__ import annotations

import random

from lmkv.router.index import KVIndex, Match, block_keys

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def engine_hashes(tokens: list[int], tag: str) -> list[str]:
    """Stand-ins for an engine's own block names (opaque to the index)."""
    return [f"{tag}:{i}:{hash(tuple(tokens[:(i + 1) * BS]))}" for i in range(len(tokens) // BS)]


def test_the_longest_prefix_per_instance_and_cache() -> None:
    index = KVIndex()
    tokens = prompt(BS * 10, 1)
    names = engine_hashes(tokens, "a")
    # a: the engine holds 6 blocks, lmkv holds 10; b: the engine holds 3
    assert index.stored("a", names[:6], tokens[:6 * BS], BS) == 6
    index.stored("a", names, tokens, BS, medium="lmkv:cpu")
    bn = engine_hashes(tokens, "b")
    index.stored("b", bn[:3], tokens[:3 * BS], BS, medium="GPU")
    keys = block_keys([*tokens, 1, 2, 3], BS)
    assert len(keys) == 10
    assert index.match(keys) == {"a": Match(6, 10), "b": Match(3, 3)}
    other = block_keys(prompt(BS * 4, 2), BS)
    assert index.match(other) == {}


def test_a_chain_continues_from_its_parent_and_a_removal_cuts_it() -> None:
    index = KVIndex()
    tokens = prompt(BS * 8, 3)
    names = engine_hashes(tokens, "a")
    index.stored("a", names[:4], tokens[:4 * BS], BS)
    # the next event names its parent by the engine's hash and carries its own tokens
    assert index.stored("a", names[4:], tokens[4 * BS:], BS, parent_hash=names[3]) == 4
    keys = block_keys(tokens, BS)
    assert index.match(keys)["a"] == Match(8, 8)
    index.removed("a", [names[5]])
    assert index.match(keys)["a"] == Match(5, 5)
    # a child whose parent the index never saw cannot be named: nothing indexed
    assert index.stored("a", ["x"], prompt(BS, 4), BS, parent_hash="unknown") == 0


def test_identity_seeds_the_chain() -> None:
    tokens = prompt(BS * 4, 5)
    assert block_keys(tokens, BS, b"lora-a") != block_keys(tokens, BS, b"lora-b")
    index = KVIndex()
    index.stored("a", engine_hashes(tokens, "a"), tokens, BS, seed=b"lora-a")
    assert index.match(block_keys(tokens, BS, b"lora-b")) == {}
    assert index.match(block_keys(tokens, BS, b"lora-a"))["a"].cached == 4


def test_cleared_and_silent_instances_hold_nothing() -> None:
    now = [0.0]
    index = KVIndex(ttl_s=10, clock=lambda: now[0])
    tokens = prompt(BS * 4, 6)
    keys = block_keys(tokens, BS)
    index.stored("a", engine_hashes(tokens, "a"), tokens, BS)
    index.stored("b", engine_hashes(tokens, "b"), tokens, BS)
    index.cleared("a")
    assert set(index.match(keys)) == {"b"}
    now[0] = 5
    index.heard("a")
    now[0] = 12
    assert index.sweep() == ["b"]
    assert index.match(keys) == {} and len(index) == 0
    assert index.instances == ["a"]


def test_the_index_stays_bounded() -> None:
    index = KVIndex(max_blocks=100)
    for p in range(50):
        tokens = prompt(BS * 10, 100 + p)
        index.stored("a", engine_hashes(tokens, "a"), tokens, BS)
    assert len(index) <= 100
    assert len(index._by_hash) <= 200
    newest = prompt(BS * 10, 149)
    assert index.match(block_keys(newest, BS))["a"] == Match(10, 10)
    assert index.match(block_keys(prompt(BS * 10, 100), BS)) == {}


def test_a_lane_given_to_a_new_instance_inherits_nothing() -> None:
    """Blocks the index can no longer name for an instance (its name map is
    bounded) are no longer its own: neither its removal nor the next instance in
    its lane sees stale bits."""
    index = KVIndex(max_blocks=10)
    tokens = prompt(BS * 10, 7)
    keys = block_keys(tokens, BS)
    for name in ("a", "b", "c"):
        index.stored(name, engine_hashes(tokens, name), tokens, BS)
    index.removed("a", engine_hashes(tokens, "a"))
    assert "a" not in index.match(keys)
    index.forget("a")
    index.heard("new")
    assert "new" not in index.match(keys)
