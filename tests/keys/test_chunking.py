from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmkv.keys.chunking import CacheKey, KeyMeta, TokenChunker, kv_geometry, prefix_hashes


def reference_hashes(tokens: list[int], chunk: int) -> list[bytes]:
    out, prev = [], b""
    for start in range(0, len(tokens) - len(tokens) % chunk, chunk):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start:start + chunk])
        prev = hashlib.sha256(prev + data).digest()
        out.append(prev)
    return out


def test_hash_is_a_sha256_chain_over_uint32_le() -> None:
    tokens = list(range(1000, 1700))
    assert prefix_hashes(tokens, 256) == reference_hashes(tokens, 256)


@pytest.mark.parametrize("convert", [
    list, tuple, np.array, lambda t: np.array(t, dtype=np.int32),
    lambda t: np.array(t, dtype=np.uint16), torch.tensor,
    lambda t: torch.tensor(t, dtype=torch.int32),
])
def test_every_input_type_hashes_the_same(convert) -> None:
    tokens = [int(x) for x in np.random.default_rng(1).integers(0, 60000, 1000)]
    assert prefix_hashes(convert(tokens), 128) == prefix_hashes(tokens, 128)


def test_a_key_names_the_whole_prefix() -> None:
    a = list(range(512))
    b = [7, *a[1:]]
    ha, hb = prefix_hashes(a, 256), prefix_hashes(b, 256)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # second chunk identical, prefix not
    assert prefix_hashes(a[:256], 256) == ha[:1]


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], [1.5], np.array([-5]),
                                 np.array([2**40]), torch.tensor([-1]),
                                 np.zeros((2, 2), dtype=np.int64), np.array([0.5])])
def test_invalid_tokens_are_rejected(bad) -> None:
    with pytest.raises(ValueError):
        prefix_hashes(bad, 1)


def test_partial_chunks() -> None:
    chunker = TokenChunker(KeyMeta("m"), 256, save_partial_chunk=True)
    chunks = chunker.chunk(list(range(600)))
    assert (chunks.starts, chunks.ends) == ([0, 256, 512], [256, 512, 600])
    assert chunker.chunk(list(range(600)), keep_partial=False).ends == [256, 512]
    assert len(TokenChunker(KeyMeta("m"), 256).chunk(list(range(255)))) == 0


def test_keys_carry_what_makes_kv_incompatible() -> None:
    tokens = list(range(256))
    base = KeyMeta("llama", 2, 0, "bfloat16", "l2thd")
    key = TokenChunker(base).chunk(tokens).keys[0]
    for other in (KeyMeta("mistral", 2, 0, "bfloat16", "l2thd"),
                  KeyMeta("llama", 4, 0, "bfloat16", "l2thd"),
                  KeyMeta("llama", 2, 1, "bfloat16", "l2thd"),
                  KeyMeta("llama", 2, 0, "float16", "l2thd"),
                  KeyMeta("llama", 2, 0, "bfloat16", "other")):
        assert TokenChunker(other).chunk(tokens).keys[0] != key
    assert TokenChunker(base).chunk(tokens).keys[0] == key


def test_key_string_round_trip() -> None:
    meta = KeyMeta("org/model@v2", 2, 1, "bfloat16", "l2thd")
    key = CacheKey(meta, bytes(range(32)))
    assert CacheKey.from_string(key.to_string()) == key
    layer_key = key.with_layer(5)
    assert layer_key.to_string().endswith("@L5")
    assert CacheKey.from_string(layer_key.to_string()) == layer_key
    with pytest.raises(ValueError):
        CacheKey.from_string("not a key")


def test_keys_parsed_from_text_share_one_meta() -> None:
    """A tier that lists a million entry names of one model holds one KeyMeta."""
    meta = KeyMeta("org/model", 2, 1, "bfloat16", "l2thd", kv_geometry(4, 2, 64))
    first, second = (CacheKey.from_string(CacheKey(meta, bytes([i]) * 32).to_string())
                     for i in range(2))
    assert first.meta == meta and first.meta is second.meta
    assert first.chunk_hash != second.chunk_hash
    other = CacheKey.from_string(CacheKey(KeyMeta("other"), bytes(32)).to_string())
    assert other.meta == KeyMeta("other") and other.meta is not first.meta


def test_layerwise_keys() -> None:
    chunker = TokenChunker(KeyMeta("m"), 4)
    chunks = chunker.chunk(list(range(12)))
    layered = chunker.layerwise_keys(chunks, 3)
    assert len(layered) == 3 and all(len(row) == 3 for row in layered)
    assert [k.layer for k in layered[1]] == [0, 1, 2]
    assert {k.chunk_hash for k in layered[1]} == {chunks.keys[1].chunk_hash}
    assert len({k for row in layered for k in row}) == 9


SCRIPT = "from lmkv.keys.chunking import prefix_hashes; " \
         "print(prefix_hashes(list(range(5000)), 256)[-1].hex())"


def test_hashes_identical_across_processes_and_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                                text=True, check=True)
        outputs.add(result.stdout.strip())
    assert outputs == {prefix_hashes(list(range(5000)), 256)[-1].hex()}


@pytest.mark.parametrize("accelerated", [True, False])
def test_list_conversion_with_and_without_the_c_accelerator(monkeypatch, accelerated) -> None:
    import lmkv.keys.chunking as tokens_mod

    if not accelerated:
        monkeypatch.setattr(tokens_mod, "_uint32_le", None)
        monkeypatch.setattr(tokens_mod, "_int64_to_uint32_le", None)
    elif tokens_mod._uint32_le is None:
        pytest.skip("the C accelerator is not built here")
    values = [0, 1, 255, 256, 65535, 65536, 2**31, 2**32 - 1]
    expected = b"".join(v.to_bytes(4, "little") for v in values)
    assert bytes(tokens_mod.token_bytes(values)) == expected
    assert bytes(tokens_mod.token_bytes(tuple(values))) == expected
    for bad in ([-1], [2**32], [1.0], ["1"], [None]):
        with pytest.raises(ValueError):
            tokens_mod.token_bytes(bad)
    for dtype in (np.int64, np.uint64):
        assert bytes(tokens_mod.token_bytes(np.array(values, dtype=dtype))) == expected
        assert bytes(tokens_mod.token_bytes(torch.tensor(values, dtype=torch.int64))) == expected
    for bad in (np.array([-1], dtype=np.int64), np.array([2**32], dtype=np.uint64),
                torch.tensor([2**40]), np.array(values, dtype=np.int64)[::2][[0, 0]] - 5):
        with pytest.raises(ValueError):
            tokens_mod.token_bytes(bad)


def test_the_c_accelerator_is_built_in_development_installs() -> None:
    """setup.py builds it when a compiler is present (CI has one): keep it from
    silently falling back to the slow path."""
    import lmkv.keys.chunking as tokens_mod

    assert tokens_mod._uint32_le is not None


def test_key_digests_name_the_fields_not_the_text() -> None:
    """Two keys whose text forms agree (a model name holding '@') differ in digest."""
    a = CacheKey(KeyMeta("x@1", 1, 0, "bfloat16", "l2thd"), b"1" * 32)
    b = CacheKey(KeyMeta("x", 1, 1, "0@bfloat16", "l2thd"), b"1" * 32)
    assert a.to_string() == b.to_string() and a.digest() != b.digest()
    assert a.digest() == CacheKey(KeyMeta("x@1", 1, 0, "bfloat16", "l2thd"), b"1" * 32).digest()
    assert len(a.digest()) == 16


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_block_chain_gives_the_two_passes_hashes(seed: int) -> None:
    """The chunker's one pass over block-aligned tokens without an identity gives
    exactly ``prefix_hashes(keep_partial=True)`` and ``block_prefix_hashes``."""
    import random

    from lmkv.keys import chunking

    rng = random.Random(seed)
    for _ in range(40):
        block = rng.choice([16, 32, 64, 128])
        chunk = block * rng.choice([1, 2, 4])
        n = rng.randint(0, 12) * block
        tokens = [rng.randrange(2**32) for _ in range(n)]
        one = chunking._block_chain(chunking.token_bytes(tokens), chunk, block)
        full = chunking.prefix_hashes(tokens, chunk, True)
        assert one == (full, chunking.block_prefix_hashes(tokens, chunk, block, full=full))
