"""docs/tiers/peer.md's protocol table names every peer message and each of its fields."""

from __future__ import annotations

import re
from pathlib import Path

from lmkv.fleet import wire
from lmkv.rpc import protocol as p

DOC = (Path(__file__).resolve().parents[2] / "docs" / "tiers" / "peer.md").read_text()
KEY_FIELDS = {"keys", "meta", "chunk_hashes", "partial_hashes"}
SESSION_FIELDS = {"session", "abandoned", "released", "server_id"}  # not used by peers


def rows() -> dict[str, str]:
    table = DOC.split("## Protocol", 1)[1]
    found = {}
    for line in table.splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_every_message_and_field_is_documented() -> None:
    table = rows()
    for request in wire.PEER_REQUESTS:
        tag = request.__struct_config__.tag
        assert tag in table, f"{tag} has no row"
        fields = set(request.__struct_fields__)
        for field in fields - KEY_FIELDS - SESSION_FIELDS:
            assert f"`{field}`" in table[tag], f"{tag}.{field} is not documented"
        if issubclass(request, p.KeyedRequest):
            assert "the keys" in table[tag]
    answers = " ".join(table.values()) + DOC.split("## Protocol", 1)[1]
    for reply in wire.PEER_REPLIES:
        tag = reply.__struct_config__.tag
        assert f"`{tag}`" in answers, f"{tag} is not documented"
        for field in set(reply.__struct_fields__) - SESSION_FIELDS:
            assert f"`{field}`" in answers, f"{tag}.{field} is not documented"
    assert f"`protocol` ({wire.PEER_PROTOCOL_VERSION})" in answers
    assert f"at most {wire.MAX_PEER_KEYS} keys" in DOC
