"""The lookup channel's messages: msgspec Structs, one msgpack-encoded ZMQ message each.

Every message is tagged with its class name (a ``"type"`` field in the msgpack
map), so one decoder tells them apart. Bytes that do not decode into one
of them (garbage, truncated, a foreign message, fields of the wrong type or
inconsistent values) raises ``msgspec.DecodeError`` / ``ValidationError``;
``decode_message`` turns that into ``None`` and a rate-limited error log.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec

from lmkv.base.logutil import RateLimitedLog

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

LookupId = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
TokenCount = Annotated[int, msgspec.Meta(ge=0)]
# sha256 digests are 32 bytes; the bound leaves room for a longer digest while
# keeping a crafted "hash" from carrying megabytes.
MAX_HASH_BYTES = 64
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]
#: The random token of one lookup (the client draws TOKEN_BYTES); "": none (an
#: older peer).
TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 64
Token = Annotated[bytes, msgspec.Meta(max_length=MAX_TOKEN_BYTES)]
# What one chunk costs in an encoded request at most: its hash (bin8 header +
# bytes) and its offset (a uint64 at most): used to bound messages before decoding.
MAX_ENCODED_CHUNK_BYTES = 2 + MAX_HASH_BYTES + 9


def max_chunks_for(max_tokens: int, chunk_size: int) -> int:
    """How many chunks a prompt of at most ``max_tokens`` tokens has (a partial last
    chunk included)."""
    return -(-max_tokens // chunk_size)


def max_request_bytes(max_chunks: int, max_blocks: int = 0) -> int:
    """The largest encoded ``LookupRequest`` of ``max_chunks`` chunks (and at most
    ``max_blocks`` partial hashes), with room for the id and modest
    ``request_configs``."""
    return (max_chunks + max_blocks) * MAX_ENCODED_CHUNK_BYTES + REQUEST_SLACK_BYTES


# Room in a request message for everything but the chunks (id, tags, request_configs).
REQUEST_SLACK_BYTES = 64 << 10


class LookupRequest(msgspec.Struct, tag=True, frozen=True):
    """Scheduler -> every worker: look up and prefetch the chunks of one prompt."""

    lookup_id: LookupId
    hashes: list[ChunkHash]
    """Prefix hash of every chunk, in order (``lmkv.keys.chunking.prefix_hashes``)."""
    offsets: list[Annotated[int, msgspec.Meta(gt=0)]]
    """Cumulative token count after each chunk: ``offsets[i]`` ends chunk ``i``."""
    request_configs: dict[str, Any] = {}
    """Per-request settings. No key is interpreted yet; workers ignore unknown
    keys, so a newer scheduler can talk to an older worker."""
    partials: list[list[ChunkHash]] = []
    """Block-granular hits: ``partials[i]`` holds the hashes of chunk ``i``'s
    leading whole blocks (``lmkv.keys.chunking.block_prefix_hashes``); empty: hits in
    whole chunks (what an older scheduler sends)."""
    block_tokens: TokenCount = 0
    """Tokens in a block of ``partials``."""
    token: Token = b""
    """A random token only the workers that received this request know; their
    answers carry it back, and the client takes no answer without it."""

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.offsets):
            raise ValueError(f"{len(self.hashes)} hashes but {len(self.offsets)} offsets")
        if any(not 0 < len(h) <= MAX_HASH_BYTES for h in self.hashes):
            raise ValueError(f"a chunk hash must be 1-{MAX_HASH_BYTES} bytes")
        if any(b <= a for a, b in zip(self.offsets, self.offsets[1:], strict=False)):
            raise ValueError("offsets must be strictly increasing")
        if self.partials:
            self._check_partials()

    def _check_partials(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError("partials need a positive block_tokens")
        if len(self.partials) > len(self.hashes):
            raise ValueError(f"{len(self.partials)} partials for {len(self.hashes)} chunks")
        start = 0
        for i, hashes in enumerate(self.partials):
            if len(hashes) * self.block_tokens > self.offsets[i] - start:
                raise ValueError(f"chunk {i}: {len(hashes)} blocks of {self.block_tokens} "
                                 f"tokens are more than its {self.offsets[i] - start}")
            start = self.offsets[i]


class LookupResponse(msgspec.Struct, tag=True, frozen=True):
    """Worker -> scheduler: the hit prefix of one lookup, in tokens."""

    lookup_id: LookupId
    num_hit_tokens: TokenCount
    rank: Annotated[int, msgspec.Meta(ge=0)]
    """The answering worker's rank: the client takes one answer per rank."""
    token: Token = b""
    """The ``token`` of the request answered."""


class LookupCleanup(msgspec.Struct, tag=True, frozen=True):
    """Scheduler -> every worker: release what a lookup prefetched."""

    lookup_id: LookupId


Message = LookupRequest | LookupResponse | LookupCleanup



class RequestHead(msgspec.Struct, tag="LookupRequest"):
    """The id and token of a ``LookupRequest`` alone: decoding them skips the hashes
    without building them (an oversize request is answered without being allocated)."""

    lookup_id: LookupId
    token: Token = b""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_head_decoder = msgspec.msgpack.Decoder(RequestHead)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> Message:
    """The message in ``data``; raises ``msgspec.DecodeError`` (or ValidationError)."""
    return _decoder.decode(data)


def decode_message(data: bytes | memoryview, where: str) -> Message | None:
    """``decode`` for a receiving thread: a bad message is logged (rate-limited), never
    raised."""
    try:
        return _decoder.decode(data)
    # ValidationError is a DecodeError; deep nesting (in request_configs) raises
    # RecursionError, which must be a rejected message like any other.
    except (msgspec.DecodeError, RecursionError) as exc:
        _log.log(logging.ERROR, f"bad-message:{where}",
                 "lmkv lookup %s: rejected a malformed message (%d bytes): %s",
                 where, len(data), exc)
        return None


def decode_request_head(data: bytes | memoryview) -> RequestHead | None:
    """The ``lookup_id`` and ``token`` of a message that holds a ``LookupRequest``,
    else None."""
    try:
        return _head_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
