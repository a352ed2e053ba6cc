"""The chunk and block hash chain in C (``lmkv._ext._tokens.block_chain``, SHA-256
with the CPU's SHA extensions or portable code) gives exactly the bytes of the
Python chain (``chunking._block_chain``, hashlib): same keys, whichever ran."""

from __future__ import annotations

import random

import pytest

from lmkv.keys import chunking
from lmkv.keys.chunking import KeyMeta, TokenChunker

_tokens = pytest.importorskip("lmkv._ext._tokens", reason="the C accelerator was not built")
ARGS = (chunking._PARTIAL, chunking._FIRST, chunking._TRAILER_TAG)


@pytest.fixture(params=[True, False], ids=["sha-ni", "portable"])
def sha_ni(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    on = _tokens.use_sha_ni(request.param)
    if request.param and not on:
        pytest.skip("this CPU has no SHA extensions")
    yield on
    _tokens.use_sha_ni(True)


def test_the_c_chain_is_the_python_chain(sha_ni: bool) -> None:
    rng = random.Random(7)
    for _ in range(300):
        block = rng.choice([1, 3, 16, 32, 128])
        chunk = block * rng.choice([1, 2, 4, 16])
        tokens = [rng.randrange(2**32) for _ in range(block * rng.randint(1, 40))]
        data = chunking.token_bytes(tokens)
        assert _tokens.block_chain(data, chunk, block, *ARGS) == \
            chunking._block_chain(data, chunk, block), (block, chunk, len(tokens))


def test_long_inputs_cross_every_buffering_case(sha_ni: bool) -> None:
    """Blocks of 1 to 20 tokens (4-80 bytes: inside a SHA-256 block, across one,
    several), over thousands of tokens."""
    rng = random.Random(8)
    for block in range(1, 21):
        tokens = [rng.randrange(2**32) for _ in range(block * 300)]
        data = chunking.token_bytes(tokens)
        assert _tokens.block_chain(data, block * 7, block, *ARGS) == \
            chunking._block_chain(data, block * 7, block)


def test_a_chunker_names_chunks_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    chunker = TokenChunker(KeyMeta("m", 1, 0, "bf16"), chunk_size=256, block_size=16)
    tokens = list(range(10_000, 10_000 + 1024))
    fast = chunker.chunk(tokens)
    monkeypatch.setattr(chunking, "_chain_c", None)
    assert chunker.chunk(tokens) == fast


def test_bad_shapes_are_one_line_errors() -> None:
    data = chunking.token_bytes(list(range(48)))  # 3 blocks of 16
    for chunk, block in ((16, 0), (0, 16), (24, 16)):  # no block, no chunk, blocks that split
        with pytest.raises(ValueError, match="block_chain"):
            _tokens.block_chain(data, chunk, block, *ARGS)
    with pytest.raises(ValueError, match="block_chain"):  # tokens that end inside a block
        _tokens.block_chain(chunking.token_bytes(list(range(40))), 32, 16, *ARGS)
    with pytest.raises(ValueError, match="block_chain"):  # bytes that are not whole tokens
        _tokens.block_chain(bytes(66), 32, 16, *ARGS)
