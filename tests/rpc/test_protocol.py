"""The protocol's messages round-trip, and docs/server.md documents every one of them."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.rpc import protocol as p

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
COMMON_FIELDS = {"req_id", "session", "abandoned", "released", "server_id", "keys", "meta",
                 "chunk_hashes", "partial_hashes"}


def sections() -> dict[str, str]:
    """``### `name` `` heading -> its text up to the next heading."""
    text = DOCS.read_text()
    parts = re.split(r"^### `([a-z_]+)`\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("cls", p.REQUESTS + p.REPLIES, ids=lambda c: c.__name__)
def test_every_message_and_field_is_documented(cls) -> None:
    tag = cls.__struct_config__.tag
    section = sections().get(tag)
    assert section is not None, f"docs/server.md has no section for {tag!r}"
    for field in set(cls.__struct_fields__) - COMMON_FIELDS:
        assert f"`{field}`" in section, f"{tag}: field {field!r} is not documented"


def test_common_fields_error_codes_and_stats_are_documented() -> None:
    text = DOCS.read_text()
    for name in [*COMMON_FIELDS, *p.ERROR_CODES, *p.ServerStats.__struct_fields__,
                 *p.ChunkInfo.__struct_fields__]:
        assert f"`{name}`" in text, name


def test_requests_round_trip_in_both_key_forms() -> None:
    meta = KeyMeta("m", 2, 1)
    keys = [CacheKey(meta, b"a" * 32), CacheKey(meta, b"b" * 32, layer=3)]
    for fields in (p.key_fields(keys), p.key_fields(keys[:1])):
        message = p.Lookup(**fields, chunk_ends=[256], lookup_id="x", req_id=5, session="s")
        decoded = p.decode_request(p.encode(message))
        assert decoded == message
        expected = keys if "keys" in fields else keys[:1]
        assert decoded.cache_keys() == expected
    assert "chunk_hashes" in p.key_fields(keys[:1]) and "keys" in p.key_fields(keys)


def test_replies_round_trip() -> None:
    reply = p.RetrieveReply(handle=3, data_path="shm", shm_name="lmkv-1",
                            chunks=[p.ChunkInfo(256, 64, [2, 16], "bfloat16")],
                            req_id=9, server_id="abc")
    assert p.decode_reply(p.encode(reply)) == reply
    assert msgspec.msgpack.decode(p.encode(p.Ping()))["op"] == "ping"


def test_undecodable_requests_are_protocol_errors() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(b"\x93\x01\x02")
    assert info.value.code == p.BAD_REQUEST
    assert p.salvage_req_id(msgspec.msgpack.encode({"req_id": 12, "op": 1})) == 12
    assert p.salvage_req_id(b"\xc1") == 0


def test_partial_hashes_round_trip_and_name_keys_under_their_chunks_meta() -> None:
    meta, other = KeyMeta("m"), KeyMeta("m", 2, 1)
    keys = [CacheKey(meta, b"a" * 32), CacheKey(other, b"b" * 32)]
    message = p.Lookup(keys=keys, chunk_ends=[32, 64], lookup_id="x",
                       **p.partial_fields([[b"p" * 32], [b"q" * 32, b"r" * 32]], 8))
    decoded = p.decode_request(p.encode(message))
    assert decoded == message and decoded.block_tokens == 8
    assert decoded.partial_keys(keys) == [[CacheKey(meta, b"p" * 32)],
                                          [CacheKey(other, b"q" * 32), CacheKey(other, b"r" * 32)]]
    old = p.decode_request(p.encode(p.Lookup(keys=keys, chunk_ends=[32, 64])))
    assert old.partial_hashes is None and old.partial_keys(keys) is None  # old clients
    assert "partial_hashes" not in msgspec.msgpack.decode(p.encode(old))
    assert p.partial_fields(None, 8) == {} and p.partial_fields([], 8) == {}
    reply = p.RetrieveReply(handle=0, data_path="inline", shm_name="", chunks=[], tail_tokens=16)
    assert p.decode_reply(p.encode(reply)).tail_tokens == 16


def test_the_client_cuts_partial_hashes_to_the_bounds() -> None:
    many = [[bytes([1 + i % 200]) * 32 for i in range(p.MAX_BLOCKS_PER_CHUNK + 5)]] * 2
    fields = p.partial_fields(many, 16)
    assert [len(hs) for hs in fields["partial_hashes"]] == [p.MAX_BLOCKS_PER_CHUNK] * 2
    decoded = p.decode_request(p.encode(p.Retrieve(meta=KeyMeta("m"), chunk_hashes=[b"a", b"b"],
                                                   **fields)))
    assert len(decoded.partial_hashes[0]) == p.MAX_BLOCKS_PER_CHUNK


@pytest.mark.parametrize("partial_hashes,reason", [
    ([[b"x" * (p.MAX_HASH_BYTES + 1)]], "length <= 64"),
    ([[b""]], "length >= 1"),
    ([[b"x"] * (p.MAX_BLOCKS_PER_CHUNK + 1)], "length <= 1024"),
    ([[]] * (p.MAX_PARTIAL_CHUNKS + 1), "length <= 65536"),
    ([["text"]], "Expected `bytes`"),
])
def test_oversized_partial_hashes_are_refused_while_decoding(partial_hashes, reason) -> None:
    raw = msgspec.msgpack.encode({"op": "lookup", "meta": {"model_name": "m"},
                                  "chunk_hashes": [b"a"], "chunk_ends": [16],
                                  "partial_hashes": partial_hashes, "block_tokens": 8})
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(raw)
    assert info.value.code == p.BAD_REQUEST and reason in info.value.reason
    assert "\n" not in info.value.reason


def test_partial_keys_and_block_tokens_are_checked() -> None:
    keys = [CacheKey(KeyMeta("m"), b"a" * 32), CacheKey(KeyMeta("m"), b"b" * 32, layer=0)]
    too_many = p.Lookup(keys=keys[:1], chunk_ends=[16], partial_hashes=[[b"p"], [b"q"]])
    layered = p.Lookup(keys=keys[1:], chunk_ends=[16], partial_hashes=[[b"p"]])
    for request, kpc, reason in ((too_many, 1, "at most one list per chunk"),
                                 (layered, 1, "without a layer"),
                                 (layered, 2, "keys_per_chunk 1")):
        with pytest.raises(p.ProtocolError, match=reason):
            request.partial_keys(request.keys, kpc)
    for block_tokens, partials, reason in ((0, [[keys[0]]], "need 1 to"),
                                           (p.MAX_BLOCK_TOKENS + 1, [[keys[0]]], "need 1 to"),
                                           (8, None, "without partial_hashes")):
        with pytest.raises(p.ProtocolError, match=reason):
            p.check_block_tokens(block_tokens, partials)
    p.check_block_tokens(0, None)
    p.check_block_tokens(16, [[keys[0]]])
