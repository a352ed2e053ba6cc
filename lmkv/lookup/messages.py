"""The lookup channel's messages: msgspec Structs, one msgpack frame each.

Every message is tagged with its class name (a ``"type"`` field in the msgpack
map), so one decoder tells them apart. A frame that does not decode into one
of them (garbage, truncated, a foreign message, fields of the wrong type or
inconsistent values) raises ``msgspec.DecodeError`` / ``ValidationError``;
``decode_frame`` turns that into ``None`` and a rate-limited error log.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec

from lmkv.logutil import RateLimitedLog

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

LookupId = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
TokenCount = Annotated[int, msgspec.Meta(ge=0)]


class LookupRequest(msgspec.Struct, tag=True, frozen=True):
    """Scheduler -> every worker: look up and prefetch the chunks of one prompt."""

    lookup_id: LookupId
    hashes: list[bytes]
    """Prefix hash of every chunk, in order (``lmkv.tokens.prefix_hashes``)."""
    offsets: list[Annotated[int, msgspec.Meta(gt=0)]]
    """Cumulative token count after each chunk: ``offsets[i]`` ends chunk ``i``."""
    request_configs: dict[str, Any] = {}
    """Per-request settings. No key is interpreted yet; workers ignore unknown
    keys, so a newer scheduler can talk to an older worker."""

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.offsets):
            raise ValueError(f"{len(self.hashes)} hashes but {len(self.offsets)} offsets")
        if any(not h for h in self.hashes):
            raise ValueError("empty chunk hash")
        if any(b <= a for a, b in zip(self.offsets, self.offsets[1:], strict=False)):
            raise ValueError("offsets must be strictly increasing")


class LookupResponse(msgspec.Struct, tag=True, frozen=True):
    """Worker -> scheduler: the hit prefix of one lookup, in tokens."""

    lookup_id: LookupId
    num_hit_tokens: TokenCount


class LookupCleanup(msgspec.Struct, tag=True, frozen=True):
    """Scheduler -> every worker: release what a lookup prefetched."""

    lookup_id: LookupId


Message = LookupRequest | LookupResponse | LookupCleanup

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """The message in ``frame``; raises ``msgspec.DecodeError`` (or ValidationError)."""
    return _decoder.decode(frame)


def decode_frame(frame: bytes | memoryview, where: str) -> Message | None:
    """``decode`` for a receiving thread: a bad frame is logged (rate-limited), never raised."""
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        _log.log(logging.ERROR, f"bad-frame:{where}",
                 "lmkv lookup %s: rejected a malformed frame (%d bytes): %s",
                 where, len(frame), exc)
        return None
