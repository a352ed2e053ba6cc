"""Request traces for ``lmkv replay``: Mooncake JSONL and plain token-id JSONL.

Both become the same thing: per request, the ids of its chunks in order, plus one
lmkv ``CacheKey`` and one parent per unique chunk. Keys are prefix keys in both
formats, so a chunk id names a whole prefix and its parent is fixed.

- Mooncake (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``):
  each hash id is one block of ``block_size`` tokens, one chunk. Its key chains
  the ids before it (``sha256(parent digest || id as 8 bytes)``): a hash id that
  reappears after another prefix is another chunk, as it would be in lmkv.
- Token ids (a JSON list of ints, or ``{"tokens": [...]}``): chunked and keyed by
  ``lmkv.keys.chunking`` exactly as an engine would, ``chunk_size`` tokens a chunk.

A bad line is one ``TraceError`` naming the file, the line number and what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Literal

from lmkv.base.errors import LMKVError
from lmkv.keys.chunking import CacheKey, KeyMeta, TokenChunker
from lmkv.replay.defaults import MOONCAKE_BLOCK_SIZE

Format = Literal["mooncake", "tokens"]
_HASH_ID_LIMIT = 1 << 64
_NUMBER_FIELDS = ("timestamp", "input_length", "output_length")


class TraceError(LMKVError):
    """A trace that cannot be replayed; the message is one line."""


@dataclass(frozen=True)
class Trace:
    """``requests[r]``: the chunk ids of request ``r`` in prompt order;
    ``keys[c]`` and ``parents[c]``: chunk ``c``'s key and the id of the chunk before
    it in its prompt (-1 for a first chunk)."""

    path: str
    format: Format
    tokens_per_chunk: int
    requests: list[list[int]]
    keys: list[CacheKey]
    parents: list[int]

    @property
    def unique_chunks(self) -> int:
        return len(self.keys)

    @property
    def chunk_requests(self) -> int:
        return sum(len(r) for r in self.requests)


def load_trace(path: str, *, fmt: Format | None = None, meta: KeyMeta,
               block_size: int = MOONCAKE_BLOCK_SIZE, chunk_size: int = 256,
               save_partial_chunk: bool = False) -> Trace:
    """Read ``path``; ``fmt`` None: told by the first record (an object with
    ``hash_ids`` is Mooncake, a list or ``{"tokens": ...}`` is token ids)."""
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    builder: _Builder | None = None
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        record = _decode(raw, where)
        if builder is None:
            chosen = fmt or _detect(record, where)
            builder = (_MooncakeBuilder(meta, block_size) if chosen == "mooncake"
                       else _TokensBuilder(meta, chunk_size, save_partial_chunk))
        builder.add(record, where)
    if builder is None:
        raise TraceError(f"{path}: empty trace: no requests (one JSON record a line)")
    if not builder.keys:
        raise TraceError(f"{path}: no request spans a whole chunk "
                         f"({builder.tokens_per_chunk} tokens a chunk)")
    return Trace(path, builder.format, builder.tokens_per_chunk, builder.requests,
                 builder.keys, builder.parents)


def _decode(raw: bytes, where: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{where}: not UTF-8") from None
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError; also a number too long to parse
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise TraceError(f"{where}: malformed JSON ({_cut(reason)})") from None
    except RecursionError:
        raise TraceError(f"{where}: malformed JSON (nested too deeply)") from None


def _detect(record: Any, where: str) -> Format:
    if isinstance(record, dict) and "hash_ids" in record:
        return "mooncake"
    if isinstance(record, list) or (isinstance(record, dict) and "tokens" in record):
        return "tokens"
    raise TraceError(f"{where}: neither a Mooncake record (an object with 'hash_ids') nor "
                     "token ids (a list of ints, or an object with 'tokens'); "
                     "see --format")


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(value: Any) -> str:
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
            float: "a number", int: "an integer", type(None): "null"}.get(type(value),
                                                                          type(value).__name__)


class _Builder:
    format: Format
    tokens_per_chunk: int

    def __init__(self) -> None:
        self.requests: list[list[int]] = []
        self.keys: list[CacheKey] = []
        self.parents: list[int] = []

    def add(self, record: Any, where: str) -> None:
        raise NotImplementedError


class _MooncakeBuilder(_Builder):
    format = "mooncake"

    def __init__(self, meta: KeyMeta, block_size: int) -> None:
        super().__init__()
        self.meta = meta
        self.tokens_per_chunk = block_size
        self._ids: dict[tuple[int, int], int] = {}  # (parent chunk, hash id) -> chunk
        self._digests: list[bytes] = []

    def add(self, record: Any, where: str) -> None:
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a Mooncake record (an object with "
                             f"'hash_ids'), got {_type_name(record)}")
        if "hash_ids" not in record:
            raise TraceError(f"{where}: missing field 'hash_ids'")
        hash_ids = record["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers, "
                             f"got {_type_name(hash_ids)}")
        for name in _NUMBER_FIELDS:
            value = record.get(name, 0)
            if type(value) not in (int, float) or not 0 <= value < math.inf:
                raise TraceError(f"{where}: {name!r} must be a non-negative number, "
                                 f"got {_cut(json.dumps(value))}")
        ids, digests, keys, parents, meta = (self._ids, self._digests, self.keys,
                                             self.parents, self.meta)
        chunks: list[int] = []
        parent = -1
        for i, hash_id in enumerate(hash_ids):
            if type(hash_id) is not int or not 0 <= hash_id < _HASH_ID_LIMIT:
                raise TraceError(f"{where}: hash_ids[{i}] = {_cut(json.dumps(hash_id))}: "
                                 "must be an integer in [0, 2**64)")
            chunk = ids.get((parent, hash_id))
            if chunk is None:
                chunk = len(keys)
                ids[(parent, hash_id)] = chunk
                prev = digests[parent] if parent >= 0 else b""
                digest = sha256(prev + hash_id.to_bytes(8, "little")).digest()
                digests.append(digest)
                keys.append(CacheKey(meta, digest))
                parents.append(parent)
            chunks.append(chunk)
            parent = chunk
        self.requests.append(chunks)


class _TokensBuilder(_Builder):
    format = "tokens"

    def __init__(self, meta: KeyMeta, chunk_size: int, save_partial_chunk: bool) -> None:
        super().__init__()
        self.tokens_per_chunk = chunk_size
        self._chunker = TokenChunker(meta, chunk_size, save_partial_chunk)
        self._ids: dict[CacheKey, int] = {}

    def add(self, record: Any, where: str) -> None:
        tokens = record.get("tokens", None) if isinstance(record, dict) else record
        if isinstance(record, dict) and "tokens" not in record:
            raise TraceError(f"{where}: missing field 'tokens'")
        if not isinstance(tokens, list):
            raise TraceError(f"{where}: expected token ids (a list of integers, or an "
                             f"object with 'tokens'), got {_type_name(tokens)}")
        bad = next((i for i, t in enumerate(tokens) if type(t) is not int
                    or not 0 <= t < 1 << 32), None)
        if bad is not None:
            raise TraceError(f"{where}: token {bad} = {_cut(json.dumps(tokens[bad]))}: "
                             "token ids must be integers in [0, 2**32)")
        ids, keys, parents = self._ids, self.keys, self.parents
        chunks: list[int] = []
        parent = -1
        for key in self._chunker.chunk(tokens).keys:
            chunk = ids.get(key)
            if chunk is None:
                chunk = ids[key] = len(keys)
                keys.append(key)
                parents.append(parent)
            chunks.append(chunk)
            parent = chunk
        self.requests.append(chunks)
