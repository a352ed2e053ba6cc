from __future__ import annotations

import logging

import msgspec
import pytest

from lmkv.lookup.messages import (
    LookupCleanup,
    LookupRequest,
    LookupResponse,
    decode,
    decode_message,
    decode_request_head,
    encode,
)


@pytest.mark.parametrize("message", [
    LookupRequest("req-1", [b"\x01" * 32, b"\x02" * 32], [256, 400], {"future": 1}),
    LookupRequest("req-2", [], []),
    LookupResponse("req-1", 512, 3),
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
    {"lookup_id": "r", "hashes": [b"h" * 65], "offsets": [1]},  # a "hash" of any size
])
def test_inconsistent_requests_do_not_decode(fields) -> None:
    message = msgspec.msgpack.encode({"type": "LookupRequest", **fields})
    with pytest.raises(msgspec.DecodeError):
        decode(message)


@pytest.mark.parametrize("hits,rank", [(-1, 0), (1, -1)])
def test_negative_hit_counts_and_ranks_do_not_decode(hits, rank) -> None:
    message = msgspec.msgpack.encode({"type": "LookupResponse", "lookup_id": "r",
                                    "num_hit_tokens": hits, "rank": rank})
    with pytest.raises(msgspec.ValidationError):
        decode(message)


def test_an_answer_without_a_rank_does_not_decode() -> None:
    message = msgspec.msgpack.encode({"type": "LookupResponse", "lookup_id": "r",
                                    "num_hit_tokens": 1})
    with pytest.raises(msgspec.ValidationError):
        decode(message)


def test_deep_nesting_is_a_rejected_message_not_a_recursion_error() -> None:
    inner = b"\x91" * 200_000 + b"\xc0"  # [[[[...]]]] in request_configs
    message = (msgspec.msgpack.encode({"type": "LookupRequest", "lookup_id": "r", "hashes": [],
                                     "offsets": [], "request_configs": {"k": 1}})[:-1] + inner)
    assert decode_message(message, "nesting-test") is None


def test_the_head_of_a_request_is_its_id_and_token_alone() -> None:
    message = encode(LookupRequest("big", [b"\x01" * 32] * 1000, list(range(1, 1001)),
                                   token=b"t" * 16))
    head = decode_request_head(message)
    assert head is not None and (head.lookup_id, head.token) == ("big", b"t" * 16)
    assert decode_request_head(encode(LookupCleanup("big"))) is None
    assert decode_request_head(b"\xc1") is None


def test_bad_messages_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lmkv.lookup.messages"):
        for message in (b"", b"\xc1", encode(LookupCleanup("x"))[:-1]):
            assert decode_message(message, "rate-test") is None
    errors = [r for r in caplog.records if "rate-test" in r.getMessage()]
    assert len(errors) == 1 and "rejected a malformed message" in errors[0].getMessage()


def test_partials_are_bounded_by_their_chunks() -> None:
    ok = LookupRequest("p", [b"a", b"b"], [32, 48], {}, [[b"x", b"y", b"z"], [b"w"]], 8)
    assert decode(encode(ok)) == ok
    for partials, block in (([[b"x"] * 5], 8),  # 40 tokens of blocks in a 32-token chunk
                            ([[b"x"]], 0),  # no block size
                            ([[b"x"], [b"y"], [b"z"]], 8)):  # more partials than chunks
        raw = {"type": "LookupRequest", "lookup_id": "p", "hashes": [b"a", b"b"],
               "offsets": [32, 48], "partials": partials, "block_tokens": block}
        with pytest.raises(msgspec.ValidationError):
            decode(msgspec.msgpack.encode(raw))
