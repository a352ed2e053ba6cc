"""Tokens -> chunk keys.

Tokens are split into chunks (default 256). A whole chunk's hash is
``sha256(previous chunk's digest || chunk tokens as little-endian uint32)``,
starting from an empty digest, so one key names a whole prefix. Nothing here
depends on ``hash()`` or PYTHONHASHSEED: hashes agree across processes,
machines and Python runs.

The same token ids do not always mean the same KV: a LoRA adapter, a tenant's
``cache_salt``, the multimodal inputs whose placeholders a chunk covers and
prompt embeddings all change it. An ``Identity`` names those; a chunk with any
of them (and a partial chunk) is hashed with a trailer::

    sha256(prev || tokens || extras digest? || uint32 token count || flags || 0xA5)

whose length is 2 mod 4, so it can never equal the input of a plain whole
chunk (0 mod 4), and whose fields read back unambiguously from the end. No
identity and whole chunks: exactly the plain hashes above.
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b, sha256
from typing import Any

import msgspec
import numpy as np

DEFAULT_CHUNK_SIZE = 256
_UINT32_MAX = 2**32 - 1
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"

# The optional C accelerator (setup.py); pure Python gives the same bytes.
_uint32_le: Callable[[list[int] | tuple[int, ...]], bytes] | None = None
_int64_to_uint32_le: Callable[[np.ndarray], bytes] | None = None
#: ``_block_chain`` in C (``_tokens.block_chain``, same bytes), where the CPU has
#: SHA extensions: a few times faster than hashlib's calls at any length (its
#: portable code is slower than OpenSSL's on long prompts: not used).
_chain_c: Callable[..., tuple[list[bytes], list[list[bytes]]]] | None = None
try:
    from lmkv._ext import _tokens
except ImportError:  # pragma: no cover - depends on the build
    pass
else:
    _uint32_le, _int64_to_uint32_le = _tokens.uint32_le, _tokens.int64_to_uint32_le
    if getattr(_tokens, "use_sha_ni", None) is not None and _tokens.use_sha_ni(True):
        _chain_c = _tokens.block_chain


_GEOMETRY = re.compile(r"\d+x\d+x\d+")


def kv_geometry(num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """``KeyMeta.geometry`` of an engine's KV: ``"<layers>x<kv heads>x<head dim>"``."""
    return f"{num_layers}x{num_kv_heads}x{head_dim}"


class KeyMeta(msgspec.Struct, frozen=True):
    """What makes stored KV incompatible between engines: part of every key.

    ``geometry`` (``kv_geometry``) keeps engines that share a model name but
    differ in layers, KV heads or head size from ever naming the same chunk.
    """

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    dtype: str = "bfloat16"
    kv_layout: str = "l2thd"
    geometry: str = ""

    def to_string(self) -> str:
        tail = f"@{self.geometry}" if self.geometry else ""
        return (f"{self.model_name}@{self.world_size}@{self.worker_id}"
                f"@{self.dtype}@{self.kv_layout}{tail}")


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
        # model @ world @ rank @ dtype @ layout [@ geometry] @ hash [@ L<layer>]
        parts = text.rsplit("@", 7)
        layer = -1
        if len(parts) > 1 and parts[-1][:1] == "L" and parts[-1][1:].isdigit():
            layer = int(parts.pop()[1:])
        geometry = ""
        if len(parts) > 2 and _GEOMETRY.fullmatch(parts[-2]):  # never a layout name
            geometry = parts.pop(-2)
        if len(parts) < 6:
            raise ValueError(f"not an lmkv key: {text!r}")
        *model, world, rank, dtype, layout, digest = parts
        try:
            meta = KeyMeta("@".join(model), int(world), int(rank), dtype, layout, geometry)
            return cls(_interned(meta), bytes.fromhex(digest), layer)
        except ValueError:
            raise ValueError(f"not an lmkv key: {text!r}") from None

    def with_layer(self, layer: int) -> CacheKey:
        return CacheKey(self.meta, self.chunk_hash, layer)

    def digest(self) -> bytes:
        """16 bytes naming the whole key (meta, chunk hash, layer): what a frame is
        bound to, so a frame moved under another key never decodes as that key."""
        # Of the fields themselves (msgpack), not of the text form: a model name may
        # hold the text form's separator.
        return blake2b(msgspec.msgpack.encode(self), digest_size=16).digest()


#: Metas parsed from text, each kept once: a tier that lists a million entries of one
#: model holds one KeyMeta (and its strings), not a million.
_METAS: dict[KeyMeta, KeyMeta] = {}
_METAS_MAX = 4096


def _interned(meta: KeyMeta) -> KeyMeta:
    known = _METAS.get(meta)
    if known is not None:
        return known
    if len(_METAS) >= _METAS_MAX:  # names from outside without end: start over
        _METAS.clear()
    _METAS[meta] = meta
    return meta


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
    return np.ascontiguousarray(arr.astype("<u4", copy=False)).data.cast("B")


def _in_uint32_range(arr: np.ndarray) -> bool:
    if arr.dtype.itemsize == 8:  # negatives wrap to huge values: one pass checks both ends
        return int(arr.view(np.uint64).max()) <= _UINT32_MAX
    if arr.dtype.kind == "i":
        return int(arr.min()) >= 0
    return True


class MMInput(msgspec.Struct, frozen=True, array_like=True):
    """One multimodal input: its content hash (vLLM's ``mm_feature.identifier``)
    and the prompt positions its placeholders take."""

    identifier: str
    offset: int
    length: int


class Identity(msgspec.Struct, frozen=True, omit_defaults=True):
    """What changes the KV of the same token ids (vLLM's block-hash extra keys).

    - ``salt``: the request's ``cache_salt`` (tenant isolation); seeds the chain
      (it enters chunk 0, so every later chunk differs too).
    - ``adapter``: the LoRA adapter (name and path, say); enters every chunk.
    - ``mm``: multimodal inputs; a chunk takes the identifier and chunk-relative
      offset of every input whose placeholders it overlaps.
    - ``embeds``: the sha256 of the prompt embeddings of each chunk
      (``Identity.embeddings`` builds it), for prompts given as embeddings.
    """

    salt: str | None = None
    adapter: str | None = None
    mm: tuple[MMInput, ...] = ()
    embeds: tuple[bytes, ...] = ()
    embeds_chunk_size: int = 0

    def __bool__(self) -> bool:
        return bool(self.salt or self.adapter or self.mm or self.embeds)

    def with_embeddings(self, embeds: Any, chunk_size: int) -> Identity:
        """This identity plus the per-chunk digests of ``embeds`` (``[tokens, hidden]``,
        a torch tensor or numpy array)."""
        if hasattr(embeds, "detach"):  # torch.Tensor; torch is imported already then
            import torch

            # As raw bytes: numpy has no bfloat16.
            embeds = embeds.detach().cpu().contiguous().view(torch.uint8).numpy()
        arr = np.ascontiguousarray(embeds)
        digests = tuple(sha256(arr[s:s + chunk_size].tobytes()).digest()
                        for s in range(0, len(arr), chunk_size))
        return msgspec.structs.replace(self, embeds=digests, embeds_chunk_size=chunk_size)

    def chunk_extras(self, start: int, end: int, index: int, chunk_size: int) -> bytes | None:
        """Digest of what enters the hash of chunk ``index`` (tokens ``[start, end)``)."""
        extras: list[Any] = []
        if self.salt and start == 0:
            extras.append(("salt", self.salt))
        if self.adapter:
            extras.append(("adapter", self.adapter))
        for item in self.mm:
            if item.offset < end and item.offset + item.length > start:
                extras.append(("mm", item.identifier, item.offset - start))
        if self.embeds:
            if self.embeds_chunk_size != chunk_size:
                raise ValueError(f"identity embeds were hashed per {self.embeds_chunk_size} "
                                 f"tokens, the chunks are {chunk_size}")
            if index < len(self.embeds):
                extras.append(("embeds", self.embeds[index]))
        if not extras:
            return None
        return sha256(msgspec.msgpack.encode(extras)).digest()


NO_IDENTITY = Identity()
_TRAILER = struct.Struct("<IBB")
_TRAILER_TAG = 0xA5
_HAS_EXTRAS, _PARTIAL, _FIRST = 1, 2, 4


def prefix_hashes(tokens: Any, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  keep_partial: bool = False,
                  identity: Identity | None = None) -> list[bytes]:
    """Chained sha256 digest of every chunk of ``tokens`` (see the module doc)."""
    data = token_bytes(tokens)
    n = len(data) // 4
    step = chunk_size * 4
    full_end = (n - n % chunk_size) * 4
    out: list[bytes] = []
    append = out.append
    prev = b""
    if not identity:
        for off in range(0, full_end, step):
            prev = sha256(prev + data[off:off + step]).digest()
            append(prev)
        if keep_partial and full_end < len(data):
            append(_trailed(prev, data[full_end:], None, partial=True))
        return out
    end = len(data) if keep_partial else full_end
    for index, off in enumerate(range(0, end, step)):
        chunk = data[off:off + step]
        start = off // 4
        extras = identity.chunk_extras(start, start + len(chunk) // 4, index, chunk_size)
        partial = len(chunk) < step
        if extras is None and not partial:
            prev = sha256(prev + chunk).digest()
        else:
            prev = _trailed(prev, chunk, extras, partial)
        append(prev)
    return out


def block_prefix_hashes(tokens: Any, chunk_size: int, block_size: int,
                        identity: Identity | None = None,
                        full: Sequence[bytes] | None = None) -> list[list[bytes]]:
    """The hashes of every chunk's leading whole blocks: ``out[c][j - 1]`` names
    tokens ``[c * chunk_size, c * chunk_size + j * block_size)`` after chunk ``c - 1``.

    For a whole chunk, ``j`` runs over the blocks shorter than the chunk; for the
    trailing partial chunk, over every whole block it covers (it may have none).
    Each is exactly the hash ``prefix_hashes(..., keep_partial=True)`` gives a
    prompt that ends there, so a block-aligned partial chunk stored on its own
    and a stored whole chunk's leading blocks (an alias, see ``lmkv.keys.aliases``)
    answer to the same key. ``full``: this prompt's ``prefix_hashes`` when the
    caller has them already.
    """
    if block_size <= 0 or chunk_size % block_size:
        raise ValueError(f"block_size {block_size} must divide chunk_size {chunk_size}")
    data = token_bytes(tokens)
    n = len(data) // 4
    if full is None:
        full = prefix_hashes(tokens, chunk_size, False, identity)
    out: list[list[bytes]] = []
    for index, start in enumerate(range(0, n, chunk_size)):
        prev = full[index - 1] if index else b""
        length = min(chunk_size, n - start)
        last = length if length < chunk_size else length - 1  # a whole chunk: shorter only
        blocks = last // block_size
        hashes: list[bytes] = []
        running = sha256(prev)
        done = 0
        for j in range(1, blocks + 1):
            end = start + j * block_size
            running.update(data[(start + done) * 4:end * 4])
            done = j * block_size
            extras = identity.chunk_extras(start, end, index, chunk_size) if identity else None
            flags = ((_HAS_EXTRAS if extras else 0) | _PARTIAL | (0 if prev else _FIRST))
            h = running.copy()
            if extras:
                h.update(extras)
            h.update(_TRAILER.pack(done, flags, _TRAILER_TAG))
            hashes.append(h.digest())
        out.append(hashes)
    return out


def _block_chain(data: memoryview, chunk_size: int, block_size: int
                 ) -> tuple[list[bytes], list[list[bytes]]]:
    """``prefix_hashes(..., keep_partial=True)`` and ``block_prefix_hashes`` of
    block-aligned tokens (``data``, as ``token_bytes``) under no identity, in one
    pass: each chunk's bytes are hashed once, its blocks' hashes taken from the
    running hash on the way, and a whole chunk's hash is where it ends."""
    n = len(data) // 4
    hashes: list[bytes] = []
    partials: list[list[bytes]] = []
    prev = b""
    for start in range(0, n, chunk_size):
        length = min(chunk_size, n - start)
        blocks = length // block_size
        whole = length == chunk_size
        flags = _PARTIAL | (0 if prev else _FIRST)
        running = sha256(prev)
        hs: list[bytes] = []
        for j in range(1, blocks + 1):
            running.update(data[(start + (j - 1) * block_size) * 4:(start + j * block_size) * 4])
            if j < blocks or not whole:
                h = running.copy()
                h.update(_TRAILER.pack(j * block_size, flags, _TRAILER_TAG))
                hs.append(h.digest())
        # a whole chunk: the chain's hash; a shorter one (block-aligned): its last
        # block's, the same trailed hash prefix_hashes gives a partial chunk
        prev = running.digest() if whole else hs[-1]
        hashes.append(prev)
        partials.append(hs)
    return hashes, partials


def _trailed(prev: bytes, chunk: memoryview, extras: bytes | None, partial: bool) -> bytes:
    flags = ((_HAS_EXTRAS if extras else 0) | (_PARTIAL if partial else 0)
             | (0 if prev else _FIRST))
    return sha256(b"".join((prev, chunk, extras or b"",
                            _TRAILER.pack(len(chunk) // 4, flags, _TRAILER_TAG)))).digest()


class ChunkKeys(msgspec.Struct, frozen=True):
    """The chunks of one token sequence: bounds and keys, in order.

    ``partials[i]`` (block-granular hits, else empty): the keys of chunk ``i``'s
    leading whole blocks shorter than it (``block_prefix_hashes``).
    """

    starts: list[int]
    ends: list[int]
    keys: list[CacheKey]
    partials: list[list[CacheKey]] = []

    def __len__(self) -> int:
        return len(self.keys)


class TokenChunker:
    """Turns token sequences into chunk keys for one engine (one KeyMeta).

    With a ``block_size`` smaller than the chunk (block-granular hits), a
    sequence's last partial chunk is cut at its last whole block and kept
    (LMCache's ``save_unfull_chunk``): a prompt is stored and matched up to its
    last whole block, and every chunk carries its leading blocks' keys.
    """

    def __init__(self, meta: KeyMeta, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 save_partial_chunk: bool = False, block_size: int | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if block_size is not None and (block_size <= 0 or chunk_size % block_size):
            raise ValueError(f"block_size {block_size} must divide chunk_size {chunk_size}")
        self.meta = meta
        self.chunk_size = chunk_size
        self.save_partial_chunk = save_partial_chunk
        #: Tokens per block of block-granular hits; None: hits in whole chunks.
        self.block_size = block_size if block_size and block_size < chunk_size else None

    def chunk(self, tokens: Any, keep_partial: bool | None = None,
              identity: Identity | None = None) -> ChunkKeys:
        keep = self.save_partial_chunk if keep_partial is None else keep_partial
        block = self.block_size
        n = len(tokens)
        partials: list[list[bytes]] = []
        if block:
            aligned = n // block * block
            if aligned != n and not keep:
                tokens, n = tokens[:aligned], aligned
            keep = True
            if identity or aligned != n:
                hashes = prefix_hashes(tokens, self.chunk_size, keep, identity)
                partials = block_prefix_hashes(tokens, self.chunk_size, block, identity,
                                               full=hashes)
            elif _chain_c is not None:  # (the common case: one pass over the tokens)
                hashes, partials = _chain_c(token_bytes(tokens), self.chunk_size, block,
                                            _PARTIAL, _FIRST, _TRAILER_TAG)
            else:
                hashes, partials = _block_chain(token_bytes(tokens), self.chunk_size, block)
        else:
            hashes = prefix_hashes(tokens, self.chunk_size, keep, identity)
        cs = self.chunk_size
        starts = [i * cs for i in range(len(hashes))]
        ends = [min(s + cs, n) for s in starts]
        meta = self.meta
        return ChunkKeys(starts, ends, [CacheKey(meta, h) for h in hashes],
                         [[CacheKey(meta, h) for h in hs] for hs in partials])

    def layerwise_keys(self, chunks: ChunkKeys, num_layers: int) -> list[list[CacheKey]]:
        """One key per (chunk, layer): ``result[chunk][layer]``."""
        return [[CacheKey(k.meta, k.chunk_hash, layer) for layer in range(num_layers)]
                for k in chunks.keys]
