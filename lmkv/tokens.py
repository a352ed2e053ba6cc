"""Tokens -> chunk keys.

Tokens are split into chunks (default 256). A chunk's hash is
``sha256(previous chunk's digest || chunk tokens as little-endian uint32)``,
starting from an empty digest, so one key names a whole prefix. Nothing here
depends on ``hash()`` or PYTHONHASHSEED: hashes agree across processes,
machines and Python runs.
"""

from __future__ import annotations

import sys
from array import array
from hashlib import sha256
from typing import Any

import msgspec
import numpy as np

DEFAULT_CHUNK_SIZE = 256
_UINT32_MAX = 2**32 - 1
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"

try:  # the optional C accelerator (setup.py); pure Python gives the same bytes
    from lmkv._ext._tokens import int64_to_uint32_le as _int64_to_uint32_le
    from lmkv._ext._tokens import uint32_le as _uint32_le
except ImportError:  # pragma: no cover - depends on the build
    _uint32_le = _int64_to_uint32_le = None


class KeyMeta(msgspec.Struct, frozen=True):
    """What makes stored KV incompatible between engines: part of every key."""

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    dtype: str = "bfloat16"
    kv_layout: str = "l2thd"

    def to_string(self) -> str:
        return (f"{self.model_name}@{self.world_size}@{self.worker_id}"
                f"@{self.dtype}@{self.kv_layout}")


class CacheKey(msgspec.Struct, frozen=True):
    """Key of one stored chunk (or one layer of a chunk when ``layer >= 0``)."""

    meta: KeyMeta
    chunk_hash: bytes
    layer: int = -1

    def to_string(self) -> str:
        """Stable text form for tiers that need string keys (files, Redis)."""
        tail = f"@L{self.layer}" if self.layer >= 0 else ""
        return f"{self.meta.to_string()}@{self.chunk_hash.hex()}{tail}"

    @classmethod
    def from_string(cls, text: str) -> CacheKey:
        layer = -1
        head, _, tail = text.rpartition("@")
        if tail.startswith("L") and tail[1:].isdigit():
            layer, text = int(tail[1:]), head
        parts = text.rsplit("@", 5)
        if len(parts) != 6:
            raise ValueError(f"not an lmkv key: {text!r}")
        model, world, rank, dtype, layout, digest = parts
        try:
            meta = KeyMeta(model, int(world), int(rank), dtype, layout)
            return cls(meta, bytes.fromhex(digest), layer)
        except ValueError:
            raise ValueError(f"not an lmkv key: {text!r}") from None

    def with_layer(self, layer: int) -> CacheKey:
        return CacheKey(self.meta, self.chunk_hash, layer)


def token_bytes(tokens: Any) -> memoryview:
    """Tokens (list, tuple, numpy array, torch tensor) as little-endian uint32 bytes.

    Token ids must lie in [0, 2**32); anything else is a ValueError, never a
    silent wrap-around that could make two prompts share a key.
    """
    if isinstance(tokens, (list, tuple)):
        try:
            if _uint32_le is not None:
                return memoryview(_uint32_le(tokens))
            packed = array(_UINT32, tokens)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        if _BIG_ENDIAN:
            packed.byteswap()
        return memoryview(packed).cast("B")
    if hasattr(tokens, "detach"):  # torch.Tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D integer sequence, got {arr.dtype} {arr.shape}")
    if _int64_to_uint32_le is not None and arr.dtype.itemsize == 8 and not _BIG_ENDIAN:
        try:  # one pass: range check and conversion
            return memoryview(_int64_to_uint32_le(np.ascontiguousarray(arr)))
        except OverflowError:
            raise ValueError("token ids must be integers in [0, 2**32)") from None
    if arr.size and not _in_uint32_range(arr):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return memoryview(np.ascontiguousarray(arr.astype("<u4", copy=False))).cast("B")


def _in_uint32_range(arr: np.ndarray) -> bool:
    if arr.dtype.itemsize == 8:  # negatives wrap to huge values: one pass checks both ends
        return int(arr.view(np.uint64).max()) <= _UINT32_MAX
    if arr.dtype.kind == "i":
        return int(arr.min()) >= 0
    return True


def prefix_hashes(tokens: Any, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  keep_partial: bool = False) -> list[bytes]:
    """Chained sha256 digest of every chunk of ``tokens``."""
    data = token_bytes(tokens)
    n = len(data) // 4
    step = chunk_size * 4
    full_end = (n - n % chunk_size) * 4
    out: list[bytes] = []
    append = out.append
    prev = b""
    for off in range(0, full_end, step):
        prev = sha256(prev + data[off:off + step]).digest()
        append(prev)
    if keep_partial and full_end < len(data):
        append(sha256(prev + data[full_end:]).digest())
    return out


class ChunkKeys(msgspec.Struct, frozen=True):
    """The chunks of one token sequence: bounds and keys, in order."""

    starts: list[int]
    ends: list[int]
    keys: list[CacheKey]

    def __len__(self) -> int:
        return len(self.keys)


class TokenChunker:
    """Turns token sequences into chunk keys for one engine (one KeyMeta)."""

    def __init__(self, meta: KeyMeta, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 save_partial_chunk: bool = False) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.meta = meta
        self.chunk_size = chunk_size
        self.save_partial_chunk = save_partial_chunk

    def chunk(self, tokens: Any, keep_partial: bool | None = None) -> ChunkKeys:
        keep = self.save_partial_chunk if keep_partial is None else keep_partial
        hashes = prefix_hashes(tokens, self.chunk_size, keep)
        n = len(tokens)
        cs = self.chunk_size
        starts = [i * cs for i in range(len(hashes))]
        ends = [min(s + cs, n) for s in starts]
        meta = self.meta
        return ChunkKeys(starts, ends, [CacheKey(meta, h) for h in hashes])

    def layerwise_keys(self, chunks: ChunkKeys, num_layers: int) -> list[list[CacheKey]]:
        """One key per (chunk, layer): ``result[chunk][layer]``."""
        return [[CacheKey(k.meta, k.chunk_hash, layer) for layer in range(num_layers)]
                for k in chunks.keys]

