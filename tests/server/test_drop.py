"""The ``drop`` request: the server removes an entry only when it differs from what
the client expects of its key, counts it once as corrupt, and refuses a malformed
request with a reason while it goes on serving. (The remote engine's side, over
a disk tier: tests/engines/test_remote_misfit.py.)"""

from __future__ import annotations

import msgspec
import pytest
import torch

from lmkv.keys.chunking import CacheKey
from lmkv.rpc import protocol as p
from lmkv.rpc.client import ServerClient
from lmkv.server.drops import entry_misfit
from tests.server.procs import (
    META,
    SHAPE,
    chunk_ends,
    chunk_for,
    free_port,
    prompt_keys,
    same_bytes,
)
from tests.server.test_errors import error_of, raw_request, still_serving

pytestmark = pytest.mark.slow  # real lmkv server processes

FEWER_TOKENS = [2, 2, 128, 2, 16]  # SHAPE's chunk cut to its first 128 tokens


def figures(client: ServerClient) -> tuple[int, int, int]:
    """(dropped_misfits, refused_drops, the memory tier's corrupt_frames) now."""
    stats = client.stats()
    assert stats is not None
    return (stats.server.dropped_misfits, stats.server.refused_drops,
            stats.tiers[0]["corrupt_frames"])


def test_an_entry_that_is_what_the_client_expects_is_kept(server) -> None:
    keys = prompt_keys(300, chunks=2)
    with server.client() as client:
        assert client.store(keys, [chunk_for(k) for k in keys]) == 2
        before = figures(client)
        assert client.drop(keys[1], SHAPE, torch.bfloat16) == "kept"
        # A chunk of more tokens than the key covers, up to a whole chunk of the
        # client's: compared by its leading tokens, as an engine loads it.
        assert client.drop(keys[1], FEWER_TOKENS, torch.bfloat16, chunk_tokens=256) == "kept"
        assert figures(client) == (before[0], before[1] + 2, before[2])
        assert client.lookup(keys, chunk_ends(keys)) == 32
        got = client.retrieve(keys)
        assert len(got) == 2 and all(same_bytes(g, chunk_for(k)) for g, k in zip(got, keys,
                                                                                  strict=True))


def test_an_entry_unlike_what_the_client_expects_is_dropped_and_counted_once(server) -> None:
    keys = prompt_keys(310, chunks=3)
    with server.client() as client, server.client() as other:
        assert client.store(keys, [chunk_for(k) for k in keys]) == 3
        before = figures(client)
        assert client.drop(keys[2], SHAPE, torch.float16) == "dropped"  # another dtype
        # More tokens than the key covers, and more than a chunk of the client holds.
        assert client.drop(keys[1], FEWER_TOKENS, torch.bfloat16, chunk_tokens=200) \
            == "dropped"
        assert figures(client) == (before[0] + 2, before[1], before[2] + 2)
        assert other.lookup(keys, chunk_ends(keys)) == 16  # a miss from there, for all
        assert client.drop(keys[1], FEWER_TOKENS, torch.float16) == "absent"
        assert figures(client) == (before[0] + 2, before[1], before[2] + 2)
        # A client trusted to store under any key could only have overwritten them:
        # the next store is served again.
        assert other.store(keys, [chunk_for(k) for k in keys]) == 2
        got = client.retrieve(keys)
        assert len(got) == 3 and all(same_bytes(g, chunk_for(k)) for g, k in zip(got, keys,
                                                                                  strict=True))


KEY = CacheKey(META, b"k" * 32)


def drop_frame(**fields) -> bytes:
    return msgspec.msgpack.encode({"op": "drop", "req_id": 5, **fields})


@pytest.mark.parametrize("frames,reason", [
    ([drop_frame(dtype="bfloat16", shape=[1])], "undecodable"),  # no key
    ([drop_frame(key={"meta": "m", "chunk_hash": 1}, dtype="bfloat16", shape=[1])],
     "undecodable"),
    ([p.encode(p.Drop(key=KEY, dtype="complex128", shape=[1]))], "dtype"),
    ([p.encode(p.Drop(key=KEY, dtype="bfloat16", shape=[]))], "dimensions"),
    ([p.encode(p.Drop(key=KEY, dtype="bfloat16", shape=[2, 0]))], "dimension 0"),
    ([p.encode(p.Drop(key=KEY, dtype="uint8", shape=[1 << 40]))], "larger than"),
    ([p.encode(p.Drop(key=KEY, dtype="bfloat16", shape=[1], chunk_tokens=-1))],
     "undecodable"),
    ([p.encode(p.Drop(key=KEY, dtype="bfloat16", shape=[1], chunk_tokens=1 << 20))],
     "undecodable"),
    ([p.encode(p.Drop(key=KEY, dtype="bfloat16", shape=[1])), b"data"],
     "unexpected data parts"),
])
def test_a_malformed_drop_gets_a_reason_and_the_server_goes_on(server, frames, reason) -> None:
    with server.client() as client:
        bad = client.stats().server.bad_requests
        reply = error_of(raw_request(server.address, frames))
        assert reply.code == p.BAD_REQUEST and reason in reply.reason, reply.reason
        assert client.stats().server.bad_requests == bad + 1
    still_serving(server)


def test_a_drop_without_a_server_is_a_logged_miss_not_an_exception() -> None:
    with ServerClient(f"tcp://127.0.0.1:{free_port()}", timeout_ms=100) as client:
        assert client.drop(KEY, SHAPE, torch.bfloat16) is None
        assert client.counters.unreachable == 1


@pytest.mark.parametrize("entry,expected,chunk_tokens,fits", [
    ((2, 2, 16, 2, 8), [2, 2, 16, 2, 8], 0, True),
    ((2, 2, 32, 2, 8), [2, 2, 16, 2, 8], 32, True),    # cut to its leading tokens
    ((2, 2, 32, 2, 8), [2, 2, 16, 2, 8], 16, False),   # more than a chunk
    ((2, 2, 32, 2, 8), [2, 2, 16, 2, 8], 0, False),
    ((2, 2, 8, 2, 8), [2, 2, 16, 2, 8], 32, False),    # fewer tokens
    ((2, 2, 16, 4, 8), [2, 2, 16, 2, 8], 32, False),   # other heads
    ((2, 2, 32, 4, 8), [2, 2, 16, 2, 8], 32, False),
    ((4, 16), [4, 8], 16, False),                       # not a KV chunk: exactly
])
def test_entry_misfit(entry, expected, chunk_tokens, fits) -> None:
    tensor = torch.zeros(entry, dtype=torch.float16)
    assert (entry_misfit(tensor, torch.float16, expected, chunk_tokens) is None) == fits
    assert entry_misfit(tensor, torch.bfloat16, list(entry), chunk_tokens) is not None
