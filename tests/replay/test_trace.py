"""Both trace formats become chunk ids with prefix keys and parents."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from lmkv.keys.chunking import TokenChunker
from lmkv.replay.trace import TraceError, load_trace
from tests.replay.conftest import META


def test_mooncake_hash_ids_become_chained_chunks(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    trace = load_trace(str(mooncake([[1, 2, 3], [1, 2, 4], [5, 2, 3]])), meta=META)
    assert trace.format == "mooncake"
    assert trace.tokens_per_chunk == 512
    # [1, 2] is shared; 2 after 5 is another prefix, hence another chunk.
    assert trace.requests == [[0, 1, 2], [0, 1, 3], [4, 5, 6]]
    assert trace.unique_chunks == 7 and trace.chunk_requests == 9
    assert trace.parents == [-1, 0, 1, 1, -1, 4, 5]
    assert len({k.chunk_hash for k in trace.keys}) == 7
    assert all(k.meta == META for k in trace.keys)


def test_mooncake_keys_are_deterministic(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    first = load_trace(str(mooncake([[7, 8], [7, 9]])), meta=META)
    again = load_trace(str(mooncake([[7, 9], [7, 8]])), meta=META)
    assert {k.chunk_hash for k in first.keys} == {k.chunk_hash for k in again.keys}


def test_block_size_sets_the_tokens_a_chunk(
        mooncake: Callable[[Sequence[Sequence[int]]], Path]) -> None:
    assert load_trace(str(mooncake([[1]])), meta=META, block_size=16).tokens_per_chunk == 16


def test_token_lists_are_chunked_as_an_engine_would(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    first, second = list(range(1, 10)), [1, 2, 3, 4, 9, 9, 9, 9]
    path.write_text(json.dumps(first) + "\n\n" + json.dumps({"tokens": second}) + "\n")
    trace = load_trace(str(path), meta=META, chunk_size=4)
    assert trace.format == "tokens" and trace.tokens_per_chunk == 4
    assert trace.requests == [[0, 1], [0, 2]]  # 9 tokens: two whole chunks
    assert trace.parents == [-1, 0, 0]
    expected = TokenChunker(META, 4).chunk(first).keys
    assert trace.keys[:2] == expected


def test_partial_chunks_count_when_the_config_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(list(range(9))) + "\n")
    trace = load_trace(str(path), meta=META, chunk_size=4, save_partial_chunk=True)
    assert trace.requests == [[0, 1, 2]]


def test_the_format_can_be_forced(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps([1, 2, 3, 4]) + "\n")
    with pytest.raises(TraceError, match="line 1: expected a Mooncake record"):
        load_trace(str(path), fmt="mooncake", meta=META)


@pytest.mark.parametrize(("text", "expect"), [
    ('{"hash_ids": [1]}\n{"hash_ids": [1,\n', "line 2: malformed JSON"),
    ('{"hash_ids": [1]}\n\n{"timestamp": 3}\n', "line 3: missing field 'hash_ids'"),
    ('{"hash_ids": "12"}\n', "line 1: 'hash_ids' must be a list of integers, got a string"),
    ('{"hash_ids": [1, -2]}\n', "line 1: hash_ids[1] = -2: must be an integer"),
    ('{"hash_ids": [1, true]}\n', "line 1: hash_ids[1] = true"),
    ('{"hash_ids": [1], "timestamp": "soon"}\n', "'timestamp' must be a non-negative number"),
    ('{"hash_ids": [1], "output_length": NaN}\n', "'output_length' must be a non-negative"),
    ('{"hash_ids": [1], "input_length": -Infinity}\n', "'input_length' must be a non-negative"),
    ('[1, 2, "x"]\n', "line 1: token 2 = \"x\": token ids must be integers"),
    ('[1, 2]\n{"hash_ids": [1]}\n', "line 2: missing field 'tokens'"),
    ('[1, 2]\n7\n', "line 2: expected token ids"),
    ("5\n", "line 1: neither a Mooncake record"),
    ("", "empty trace"),
    ("\n  \n", "empty trace"),
    ("[1, 2]\n", "no request spans a whole chunk (256 tokens a chunk)"),
])
def test_bad_traces_are_one_line(tmp_path: Path, text: str, expect: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(str(path), meta=META)
    message = str(info.value)
    assert expect in message and "\n" not in message
    assert str(path) in message


def test_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(TraceError, match="line 2: not UTF-8"):
        load_trace(str(path), meta=META)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read trace .*No such file"):
        load_trace(str(tmp_path / "none.jsonl"), meta=META)
