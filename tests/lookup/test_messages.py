from __future__ import annotations

import logging

import msgspec
import pytest

from lmkv.lookup.messages import (
    LookupCleanup,
    LookupRequest,
    LookupResponse,
    decode,
    decode_frame,
    encode,
)


@pytest.mark.parametrize("message", [
    LookupRequest("req-1", [b"\x01" * 32, b"\x02" * 32], [256, 400], {"future": 1}),
    LookupRequest("req-2", [], []),
    LookupResponse("req-1", 512),
    LookupCleanup("req-1"),
])
def test_one_decoder_tells_every_message_apart(message) -> None:
    assert decode(encode(message)) == message


def test_request_configs_default_to_empty() -> None:
    request = decode(encode(LookupRequest("r", [b"h"], [3])))
    assert request.request_configs == {}


@pytest.mark.parametrize("fields", [
    {"lookup_id": "r", "hashes": [b"h"], "offsets": []},  # one hash, no offset
    {"lookup_id": "r", "hashes": [b"h", b"i"], "offsets": [5, 5]},  # not increasing
    {"lookup_id": "r", "hashes": [b"h"], "offsets": [0]},  # not positive
    {"lookup_id": "r", "hashes": [b""], "offsets": [1]},  # empty hash
    {"lookup_id": "", "hashes": [], "offsets": []},  # empty id
    {"lookup_id": "r", "hashes": ["text"], "offsets": [1]},  # hashes are bytes
])
def test_inconsistent_requests_do_not_decode(fields) -> None:
    frame = msgspec.msgpack.encode({"type": "LookupRequest", **fields})
    with pytest.raises(msgspec.DecodeError):
        decode(frame)


def test_negative_hit_counts_do_not_decode() -> None:
    frame = msgspec.msgpack.encode({"type": "LookupResponse", "lookup_id": "r",
                                    "num_hit_tokens": -1})
    with pytest.raises(msgspec.ValidationError):
        decode(frame)


def test_bad_frames_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lmkv.lookup.messages"):
        for frame in (b"", b"\xc1", encode(LookupCleanup("x"))[:-1]):
            assert decode_frame(frame, "rate-test") is None
    errors = [r for r in caplog.records if "rate-test" in r.getMessage()]
    assert len(errors) == 1 and "rejected a malformed frame" in errors[0].getMessage()
