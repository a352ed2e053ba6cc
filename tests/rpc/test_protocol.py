"""The protocol's messages round-trip, and docs/server.md documents every one of them."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from lmkv.rpc import protocol as p
from lmkv.tokens import CacheKey, KeyMeta

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
COMMON_FIELDS = {"req_id", "session", "abandoned", "server_id", "keys", "meta", "chunk_hashes"}


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
