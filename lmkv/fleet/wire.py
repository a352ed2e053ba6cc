"""The peer protocol: what one lmkv instance asks of another's memory tier.

The same framing as the lmkv server protocol (``lmkv.rpc.protocol``): a
message is ``[header, *data]``, ``header`` a msgpack map whose ``op`` names
it. Data parts are lmkv frames (``lmkv.contracts.serde``), each bound to the
key it was asked for: the reading side decodes every frame under the key it
asked for and checks its checksum, so a peer that answers with another key's
frame, another peer's frame or garbage gives a miss, never wrong KV.

* ``peer_fetch`` (keys) -> ``peer_fetch_reply`` (``frames``: how many of the
  leading keys it answers; one data part each). With ``probe``, no data parts:
  only the count, for a lookup.
* ``peer_put`` (keys, one frame per key as data parts) -> ``peer_put_reply``
  (``accepted``: how many it stored). Sent to a chunk's owner.
* ``peer_remove`` (keys) -> ``peer_remove_reply`` (``removed``): drop them from
  the owner's memory tier (a frame a reader found corrupt, an operator's drop).
* ``peer_ping`` -> ``peer_ping_reply`` (the protocol version and the instance's
  address); anything else -> ``error`` (``bad_request``).

docs/tiers/peer.md documents every message and field; a test keeps them in step.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmkv.rpc import protocol as p

#: 1: peer_fetch (with probe), peer_put, peer_remove, peer_ping.
PEER_PROTOCOL_VERSION = 1
#: The most keys one peer request may name.
MAX_PEER_KEYS = 1024


class PeerFetch(p.KeyedRequest, tag="peer_fetch", kw_only=True):
    #: Answer the count only (no frames): a lookup's question.
    probe: bool = False


class PeerPut(p.KeyedRequest, tag="peer_put", kw_only=True):
    pass


class PeerRemove(p.KeyedRequest, tag="peer_remove", kw_only=True):
    pass


class PeerPing(p.Request, tag="peer_ping", kw_only=True):
    pass


class PeerFetchReply(p.Reply, tag="peer_fetch_reply", kw_only=True):
    #: How many of the leading keys are answered (one data part each, unless probed).
    frames: Annotated[int, msgspec.Meta(ge=0)] = 0


class PeerPutReply(p.Reply, tag="peer_put_reply", kw_only=True):
    accepted: Annotated[int, msgspec.Meta(ge=0)] = 0


class PeerRemoveReply(p.Reply, tag="peer_remove_reply", kw_only=True):
    removed: Annotated[int, msgspec.Meta(ge=0)] = 0


class PeerPingReply(p.Reply, tag="peer_ping_reply", kw_only=True):
    protocol: int = PEER_PROTOCOL_VERSION
    #: The address the instance serves its peers on.
    address: str = ""


PEER_REQUESTS: tuple[type[p.Request], ...] = (PeerFetch, PeerPut, PeerRemove, PeerPing)
PEER_REPLIES: tuple[type[p.Reply], ...] = (PeerFetchReply, PeerPutReply, PeerRemoveReply,
                                           PeerPingReply,
                                           p.ErrorReply)
AnyPeerRequest = PeerFetch | PeerPut | PeerRemove | PeerPing
AnyPeerReply = (PeerFetchReply | PeerPutReply | PeerRemoveReply | PeerPingReply
                | p.ErrorReply)

_request_decoder = msgspec.msgpack.Decoder(AnyPeerRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyPeerReply)


def decode_peer_request(data: bytes | memoryview) -> AnyPeerRequest:
    """The request in ``data``; ``ProtocolError`` (bad_request) when it is not one
    of a peer's, or names more than ``MAX_PEER_KEYS`` keys. Any failure is the
    sender's, as in ``lmkv.rpc.protocol.decode_request``."""
    try:
        req = _request_decoder.decode(data)
    except Exception as exc:
        raise p.ProtocolError(p.BAD_REQUEST, "not a peer request (peer_fetch, peer_put, "
                              f"peer_remove, peer_ping): {p.one_line(exc)}") from None
    if isinstance(req, p.KeyedRequest):
        count = len(req.keys if req.keys is not None else req.chunk_hashes or ())
        if count > MAX_PEER_KEYS:
            raise p.ProtocolError(p.BAD_REQUEST, f"{count} keys: at most {MAX_PEER_KEYS} "
                                  "allowed")
        if req.partial_hashes is not None:
            raise p.ProtocolError(p.BAD_REQUEST, "partial_hashes: not taken by a peer")
    return req


def decode_peer_reply(data: bytes | memoryview) -> AnyPeerReply:
    """The reply in ``data``; ``UndecodableReply`` (one line) when it is not one."""
    try:
        return _reply_decoder.decode(data)
    except Exception as exc:
        raise p.UndecodableReply(p.one_line(exc)) from None
