"""The lmkv server protocol: msgspec Structs, msgpack-encoded, one tagged union each way.

A request is one ZMQ multipart message ``[header, *data]``: ``header`` is a
msgpack map whose ``op`` field names the message; ``data`` parts carry raw
chunk bytes (only ``store_commit`` on the inline data path). A reply is
``[header, *data]`` too (``retrieve_reply`` on the inline data path carries
one data part per chunk). The *data path* says how chunk bytes move: ``shm``
(through the server's shared-memory arena) or ``inline`` (inside the message).
Every message, field and error code is documented in docs/server.md; a test
keeps the two in step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import torch

from lmkv.config.model import MAX_CHUNK_TOKENS
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import shape_problem

logger = logging.getLogger(__name__)

#: 2: ``lend`` on ``lookup`` (and what its reply lends), ``released`` on every
#: request. A client tells servers of version 1 about its releases otherwise.
PROTOCOL_VERSION = 2
#: The first protocol version whose servers read ``released``.
RELEASED_SINCE = 2

DataPath = Literal["shm", "inline"]

# Error codes of ErrorReply.
BAD_REQUEST = "bad_request"
TOO_LARGE = "too_large"
UNKNOWN_HANDLE = "unknown_handle"
OVER_LIMIT = "over_limit"
INTERNAL = "internal"
ERROR_CODES = (BAD_REQUEST, TOO_LARGE, UNKNOWN_HANDLE, OVER_LIMIT, INTERNAL)

# Request ids a client may name in one request's ``abandoned``.
MAX_ABANDONED = 1024
# Handles a client may name in one request's ``released``.
MAX_RELEASED = 1024

# Bounds of ``partial_hashes`` (block-granular hits), checked while decoding:
# a crafted request cannot make the server build more than this many lists, of
# at most this many hashes, each at most this long.
MAX_PARTIAL_CHUNKS = 1 << 16
MAX_BLOCKS_PER_CHUNK = 1024
MAX_HASH_BYTES = 64
MAX_BLOCK_TOKENS = 1 << 20

BlockHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]
PartialHashes = Annotated[
    list[Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_CHUNK)]],
    msgspec.Meta(max_length=MAX_PARTIAL_CHUNKS)]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
                 "int32", "int64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


class ProtocolError(Exception):
    """A request the server refuses; becomes an ErrorReply with ``code`` and ``reason``."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# -- requests -----------------------------------------------------------------

class Request(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    req_id: int = 0
    session: str = ""
    # Earlier requests of this session whose results the client will never use
    # (it timed out, or could not release them): the server releases what they
    # hold now, or as soon as they produce it.
    abandoned: list[int] = msgspec.field(default_factory=list)
    # Leases the client is done with, each ``[handle, req_id]`` (the request that
    # lent it: a handle id of an earlier server run never releases another's
    # lease), carried by the session's next request instead of a message of
    # their own.
    released: list[tuple[int, int]] = msgspec.field(default_factory=list)


class KeyedRequest(Request, kw_only=True):
    """Chunk keys, in one of two forms: ``keys``, or ``meta`` with ``chunk_hashes``.

    ``partial_hashes[i]`` (block-granular hits, ``lmkv.keys.aliases``): the hashes of
    chunk ``i``'s leading whole blocks (``lmkv.keys.chunking.block_prefix_hashes``),
    each under chunk ``i``'s meta; fewer lists than chunks: none for the rest.
    """

    keys: list[CacheKey] | None = None
    meta: KeyMeta | None = None
    chunk_hashes: list[bytes] | None = None
    partial_hashes: PartialHashes | None = None

    def has_keys(self) -> bool:
        return self.keys is not None or self.chunk_hashes is not None

    def cache_keys(self) -> list[CacheKey]:
        if self.keys is not None:
            if self.meta is not None or self.chunk_hashes is not None:
                raise ProtocolError(BAD_REQUEST, "give keys, or meta and chunk_hashes, not both")
            return self.keys
        if self.meta is None or self.chunk_hashes is None:
            raise ProtocolError(BAD_REQUEST, "no keys: give keys, or meta and chunk_hashes")
        meta = self.meta
        return [CacheKey(meta, h) for h in self.chunk_hashes]

    def partial_keys(self, keys: list[CacheKey], keys_per_chunk: int = 1
                     ) -> list[list[CacheKey]] | None:
        """The keys of ``partial_hashes`` (None when not given); ProtocolError
        (bad_request) unless they can be: one chunk a key, no more lists than chunks."""
        hashes = self.partial_hashes
        if hashes is None:
            return None
        if keys_per_chunk != 1:
            raise ProtocolError(BAD_REQUEST, "partial_hashes need keys_per_chunk 1")
        if len(hashes) > len(keys):
            raise ProtocolError(BAD_REQUEST, f"partial_hashes for {len(hashes)} chunks: "
                                f"at most one list per chunk ({len(keys)})")
        if any(k.layer >= 0 for k in keys[:len(hashes)]):
            raise ProtocolError(BAD_REQUEST, "partial_hashes need chunk keys without a layer")
        return [[CacheKey(key.meta, h) for h in hs] for key, hs in zip(keys, hashes,
                                                                       strict=False)]


def check_block_tokens(block_tokens: int, partials: list[list[CacheKey]] | None) -> None:
    """ProtocolError (bad_request) unless ``block_tokens`` is a block size that
    ``partials`` (a request's ``partial_keys``) can be read with."""
    if partials is None:
        if block_tokens:
            raise ProtocolError(BAD_REQUEST, "block_tokens without partial_hashes")
        return
    if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise ProtocolError(BAD_REQUEST, f"block_tokens {block_tokens}: partial_hashes "
                            f"need 1 to {MAX_BLOCK_TOKENS}")


class Ping(Request, tag="ping", kw_only=True):
    pass


class Lookup(KeyedRequest, tag="lookup", kw_only=True):
    chunk_ends: list[int]
    lookup_id: str = ""
    prefetch: bool = True
    wait: bool = True
    keys_per_chunk: int = 1
    block_tokens: int = 0  # tokens in a block of ``partial_hashes``
    # With prefetch, from a client that maps the server's arena: lend the
    # prefetched chunks in the reply once they are there, as a Retrieve of
    # ``lookup_id`` would (the client then needs no Retrieve). ``process`` as in
    # Retrieve.
    lend: bool = False
    process: str = ""


class PrefetchStatus(Request, tag="prefetch_status", kw_only=True):
    lookup_id: str


class Retrieve(KeyedRequest, tag="retrieve", kw_only=True):
    lookup_id: str = ""
    keys_per_chunk: int = 1
    block_tokens: int = 0
    data_path: DataPath = "shm"
    # The client's process (lmkv.rpc.liveness), for shared memory; a claim the server
    # checks (the ipc peer's pid, or a process that maps the arena), never trusts.
    process: str = ""


class Store(KeyedRequest, tag="store", kw_only=True):
    shapes: list[list[int]]
    dtype: str
    data_path: DataPath = "shm"
    process: str = ""


class StoreCommit(Request, tag="store_commit", kw_only=True):
    handle: int


class Release(Request, tag="release", kw_only=True):
    handle: int = 0
    lookup_id: str = ""


class Renew(Request, tag="renew", kw_only=True):
    """The client's heartbeat while it copies: keeps the session and these handles alive."""

    handles: list[int] = msgspec.field(default_factory=list)


class EndSession(Request, tag="end_session", kw_only=True):
    pass


class Drop(Request, tag="drop", kw_only=True):
    """Remove the entry under ``key``: the client read it and it is not the KV the key
    names. ``dtype`` and ``shape`` are what the client expected for the tokens the
    key covers; the server drops the entry only when it differs from them."""

    key: CacheKey
    dtype: str
    shape: list[int]
    # An entry may hold more tokens than the key covers (block-granular hits: an
    # alias's target), up to this many: its leading ones are compared. 0: exactly.
    chunk_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNK_TOKENS)] = 0


class Stats(Request, tag="stats", kw_only=True):
    pass


REQUESTS: tuple[type[Request], ...] = (Ping, Lookup, PrefetchStatus, Retrieve, Store,
                                       StoreCommit, Release, Renew, EndSession, Stats, Drop)
AnyRequest = (Ping | Lookup | PrefetchStatus | Retrieve | Store | StoreCommit | Release
              | Renew | EndSession | Stats | Drop)


# -- replies ------------------------------------------------------------------

class Reply(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    req_id: int = 0
    server_id: str = ""


class ChunkInfo(msgspec.Struct, array_like=True):
    """Where one chunk's bytes are: ``[offset, nbytes, shape, dtype]``."""

    offset: int
    nbytes: int
    shape: list[int]
    dtype: str


class PingReply(Reply, tag="ping_reply", kw_only=True):
    protocol: int
    pid: int
    host_id: str
    shm_name: str
    shm_size: int
    max_request_bytes: int
    session_timeout_s: float
    handle_ttl_s: float


class LookupReply(Reply, tag="lookup_reply", kw_only=True):
    lookup_id: str
    hit_tokens: int
    done: bool
    # A lookup with ``lend`` whose chunks were lent: the lease (a RetrieveReply's
    # handle, shm_name and chunks, on the shm data path); 0 when nothing was lent.
    handle: int = 0
    shm_name: str = ""
    chunks: list[ChunkInfo] = msgspec.field(default_factory=list)
    # The key (chunk hash, under the lookup's meta) of each lent chunk: a partial
    # hit's chunk under its leading blocks' hash.
    lent_hashes: list[bytes] = msgspec.field(default_factory=list)


class PrefetchStatusReply(Reply, tag="prefetch_status_reply", kw_only=True):
    lookup_id: str
    state: Literal["unknown", "pending", "done"]
    hit_tokens: int


class RetrieveReply(Reply, tag="retrieve_reply", kw_only=True):
    handle: int
    data_path: DataPath
    shm_name: str
    chunks: list[ChunkInfo]
    # > 0: the last chunk is a partial hit (block-granular hits): only its first
    # ``tail_tokens`` tokens are the asked chunk's leading blocks.
    tail_tokens: int = 0


class StoreReply(Reply, tag="store_reply", kw_only=True):
    handle: int
    first: int
    data_path: DataPath
    shm_name: str
    chunks: list[ChunkInfo]


class StoreCommitReply(Reply, tag="store_commit_reply", kw_only=True):
    stored: int


class ReleaseReply(Reply, tag="release_reply", kw_only=True):
    released: int


class RenewReply(Reply, tag="renew_reply", kw_only=True):
    renewed: int
    # The handles asked for that this session does not hold (released, committed or
    # expired): the client tells its own releases from losses.
    missing: list[int] = msgspec.field(default_factory=list)


class EndSessionReply(Reply, tag="end_session_reply", kw_only=True):
    lookups: int
    chunks: int


DropOutcome = Literal["dropped", "kept", "absent"]


class DropReply(Reply, tag="drop_reply", kw_only=True):
    # dropped: the entry differed from what the client expected, and is gone from
    # every tier; kept: it is what the client expected; absent: no tier holds it.
    outcome: DropOutcome


class ServerStats(msgspec.Struct, kw_only=True):
    sessions: int
    requests: int
    error_replies: int
    bad_requests: int
    expired_sessions: int
    expired_handles: int
    abandoned_handles: int
    quarantined_chunks: int
    held_lookups: int
    dropped_lookups: int
    staged_chunks: int
    leased_chunks: int
    sending_chunks: int
    arena_live_objects: int
    arena_used_bytes: int
    shm_name: str
    # Requests refused or cut short by a session's limits (0 from an older server).
    over_limit: int = 0
    # Drop requests that removed an entry, and those that found it as expected (kept).
    dropped_misfits: int = 0
    refused_drops: int = 0


class StatsReply(Reply, tag="stats_reply", kw_only=True):
    server: ServerStats
    tiers: list[dict[str, Any]]
    # The server's recorded figures (lmkv.metrics): counters, gauges, histograms
    # (count, sum); empty from a server that predates them.
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorReply(Reply, tag="error", kw_only=True):
    code: str
    reason: str


REPLIES: tuple[type[Reply], ...] = (PingReply, LookupReply, PrefetchStatusReply, RetrieveReply,
                                    StoreReply, StoreCommitReply, ReleaseReply, RenewReply,
                                    EndSessionReply, StatsReply, DropReply, ErrorReply)
AnyReply = (PingReply | LookupReply | PrefetchStatusReply | RetrieveReply | StoreReply
            | StoreCommitReply | ReleaseReply | RenewReply | EndSessionReply | StatsReply
            | DropReply | ErrorReply)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


class UndecodableReply(ValueError):
    """A reply that is not one of REPLIES (garbage, or a hostile peer)."""


def decode_request(data: bytes | memoryview) -> AnyRequest:
    """The request in ``data``; ProtocolError(bad_request) when it is not one.

    Any failure is the sender's: msgspec's errors, but also RecursionError (deep
    nesting), MemoryError (absurd lengths) and whatever else a crafted message can
    provoke, so every one of them is a ``bad_request``, never ``internal``.
    """
    try:
        req = _request_decoder.decode(data)
    except Exception as exc:
        raise ProtocolError(BAD_REQUEST, f"undecodable request: {_decode_failure(exc)}"
                            ) from None
    if len(req.abandoned) > MAX_ABANDONED:
        raise ProtocolError(BAD_REQUEST, f"{len(req.abandoned)} abandoned request ids: "
                            f"at most {MAX_ABANDONED} allowed")
    if len(req.released) > MAX_RELEASED:
        raise ProtocolError(BAD_REQUEST, f"{len(req.released)} released handles: "
                            f"at most {MAX_RELEASED} allowed")
    return req


def decode_reply(data: bytes | memoryview) -> AnyReply:
    """The reply in ``data``; UndecodableReply (one line) when it is not one."""
    try:
        return _reply_decoder.decode(data)
    except Exception as exc:
        raise UndecodableReply(_decode_failure(exc)) from None


def _decode_failure(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, MemoryError):
        return "a length too large to hold"
    return one_line(exc)


def salvage_req_id(data: bytes | memoryview) -> int:
    """The ``req_id`` of a request that failed to decode, when it can be read; else 0."""
    if len(data) > 1 << 16:
        return 0
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:  # as in decode_request: any failure is the sender's
        return 0
    req_id = raw.get("req_id") if isinstance(raw, dict) else None
    return req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else 0


def dtype_of(name: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(BAD_REQUEST, f"dtype {name!r}: allowed: {', '.join(DTYPES)}")
    return dtype


def check_shape(shape: list[int], itemsize: int, max_bytes: int) -> int:
    """The byte size of a chunk of ``shape``; ProtocolError(bad_request) unless it is
    one a chunk can have (``lmkv.memory.shape_problem``)."""
    problem = shape_problem(shape, itemsize, max_bytes)
    if problem is not None:
        raise ProtocolError(BAD_REQUEST, problem)
    return math.prod(shape) * itemsize


def key_fields(keys: list[CacheKey]) -> dict[str, Any]:
    """The compact wire form of ``keys``: meta and hashes when they share one meta."""
    if keys:
        meta = keys[0].meta
        if all(k.meta == meta and k.layer < 0 for k in keys):
            return {"meta": meta, "chunk_hashes": [k.chunk_hash for k in keys]}
    return {"keys": keys}


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def partial_fields(partial_hashes: Sequence[Sequence[bytes]] | None, block_tokens: int = 0
                   ) -> dict[str, Any]:
    """The wire form of block-granular hits' hashes (``partial_hashes``, and
    ``block_tokens`` when given): {} when there are none. Lists past the bounds the
    server accepts are cut (a chunk's later blocks, later chunks: fewer hits, never
    a refusal)."""
    if not partial_hashes:
        return {}
    fields: dict[str, Any] = {"partial_hashes": [
        list(hs[:MAX_BLOCKS_PER_CHUNK]) for hs in partial_hashes[:MAX_PARTIAL_CHUNKS]]}
    if block_tokens:
        fields["block_tokens"] = block_tokens
    return fields
