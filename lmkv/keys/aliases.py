"""Aliases: a stored chunk's leading blocks, found under their own keys.

Chunks keep transfers large; hits are matched at the engine's block size
(vLLM's ``block_size``). A prompt that leaves a stored prompt inside a chunk
still shares that chunk's leading blocks, but not its key (the key names the
whole chunk). So when a chunk is stored, each of its block-aligned leading
parts (``lmkv.keys.chunking.block_prefix_hashes``: the same hash a prompt ending
there gives its last, partial chunk) is stored too, as an alias: a tiny entry
that names the entry holding those tokens first (a whole chunk, or a longer
block-aligned partial chunk). A lookup that misses a whole chunk asks for its
leading blocks' keys, reads the longest alias found and then its target, and
serves the target's first blocks.

An alias entry is a 1-D uint8 buffer: ``MAGIC`` then the target's chunk hash.
It goes through every tier like any chunk (frames bind it to its key), and
its parent is its target, so a tier evicts aliases before the chunk they
name. A KV chunk is never 1-D, so the two never mix. An alias whose target is
gone is a miss, never another entry's KV: the target's key is the chunk hash
of the very tokens the alias's key names, followed by more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmkv.keys.chunking import CacheKey
from lmkv.memory import Allocate, MemoryObj

MAGIC = b"lmkv-alias\x01"


@dataclass(frozen=True)
class Alias:
    """``key`` names the leading blocks of ``target``'s tokens."""

    key: CacheKey
    target: CacheKey


def alias_shape(target: CacheKey) -> tuple[int]:
    return (len(MAGIC) + len(target.chunk_hash),)


def make_alias(target: CacheKey, allocate: Allocate) -> MemoryObj | None:
    """A buffer holding an alias of ``target`` (None: no memory for it)."""
    payload = MAGIC + target.chunk_hash
    obj = allocate(alias_shape(target), torch.uint8)
    if obj is not None:
        obj.tensor.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return obj


def is_alias(obj: MemoryObj) -> bool:
    # Told by the buffer's dtype and shape first: a chunk of KV is never a short
    # run of bytes, and its tensor (a view, made on demand) is not built to say so.
    shape = obj.shape
    if obj.dtype != torch.uint8 or len(shape) != 1 or shape[0] <= len(MAGIC):
        return False
    return bytes(obj.tensor[:len(MAGIC)].numpy()) == MAGIC


def alias_target(key: CacheKey, obj: MemoryObj) -> CacheKey | None:
    """The key an alias stored under ``key`` names; None when ``obj`` is no alias."""
    if not is_alias(obj):
        return None
    digest = bytes(obj.tensor[len(MAGIC):].numpy())
    if digest == key.chunk_hash:
        return None  # names itself: never resolved (no loops)
    return CacheKey(key.meta, digest, key.layer)


def chunk_aliases(keys: Sequence[CacheKey], partials: Sequence[Sequence[CacheKey]]
                  ) -> list[Alias]:
    """The aliases of stored chunks: each of ``partials[i]`` names ``keys[i]``'s
    leading blocks (``partials[i]`` may be shorter than ``keys``: none then)."""
    return [Alias(p, key) for key, parts in zip(keys, partials, strict=False)
            for p in parts if p != key]
