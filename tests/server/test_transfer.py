"""Store and retrieve through a real server: the shared-memory path and the inline path."""

from __future__ import annotations

import pytest
import torch

from lmkv.keys.chunking import CacheKey
from lmkv.rpc import protocol as p
from tests.server.conftest import MAX_REQUEST_BYTES
from tests.server.procs import (
    CHUNK_BYTES,
    META,
    SHAPE,
    chunk_ends,
    chunk_for,
    prompt_keys,
    same_bytes,
    wait_for,
)

pytestmark = pytest.mark.slow  # real lmkv server processes


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_store_then_retrieve_is_byte_identical(server, data_path: str) -> None:
    with server.client(data_path=data_path) as client:
        assert client.ping() is not None
        assert client.shared_memory == (data_path == "auto")
        keys = prompt_keys(100 if data_path == "auto" else 101, chunks=6)
        chunks = [chunk_for(k) for k in keys]
        assert client.store(keys, chunks) == 6
        assert client.lookup(keys, chunk_ends(keys)) == chunk_ends(keys)[-1]
        got = client.retrieve(keys)
        assert len(got) == 6 and all(same_bytes(a, b) for a, b in zip(got, chunks, strict=True))
        assert client.counters.dropped_chunks == 0 and client.counters.error_replies == 0


@pytest.mark.parametrize("writer,reader", [("auto", "inline"), ("inline", "auto")])
def test_what_one_data_path_stores_the_other_reads(server, writer: str, reader: str) -> None:
    keys = prompt_keys(110 if writer == "auto" else 111)
    chunks = [chunk_for(k) for k in keys]
    with server.client(data_path=writer) as w, server.client(data_path=reader) as r:
        assert w.store(keys, chunks) == len(keys)
        got = r.retrieve(keys)
    assert [same_bytes(a, b) for a, b in zip(got, chunks, strict=True)] == [True] * len(keys)


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_prefetch_then_retrieve_into_caller_buffers(server, data_path: str) -> None:
    keys = prompt_keys(120 if data_path == "auto" else 121, chunks=5)
    chunks = [chunk_for(k) for k in keys]
    with server.client(data_path=data_path) as client:
        client.store(keys[:3], chunks[:3])  # a stored prefix of 3 of the 5 chunks
        assert client.lookup(keys, chunk_ends(keys), lookup_id="p") == chunk_ends(keys)[2]
        out = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in keys]
        got = client.retrieve(keys, lookup_id="p", out=out)
        assert len(got) == 3 and all(g is o for g, o in zip(got, out, strict=False))
        assert all(same_bytes(out[i], chunks[i]) for i in range(3))
        assert not out[3].any()
        held = client.stats().server
        assert held.held_lookups == 0 and held.leased_chunks == 0


def test_a_store_skips_chunks_the_server_holds(server) -> None:
    keys = prompt_keys(130, chunks=4)
    chunks = [chunk_for(k) for k in keys]
    with server.client() as client:
        assert client.store(keys[:2], chunks[:2]) == 2
        assert client.store(keys, chunks) == 2  # only the two new ones travel
        assert [same_bytes(a, b) for a, b in zip(client.retrieve(keys), chunks,
                                                 strict=True)] == [True] * 4


def test_in_frame_stores_are_split_to_fit_the_request_limit(server) -> None:
    per_request = MAX_REQUEST_BYTES // CHUNK_BYTES
    keys = prompt_keys(140, chunks=per_request * 2 + 3)
    chunks = [chunk_for(k) for k in keys]
    with server.client(data_path="inline") as client:
        assert client.store(keys, chunks) == len(keys)
        before = client.stats().server.error_replies
        got = client.retrieve(keys)
        assert client.stats().server.error_replies == before
    assert len(got) == len(keys) and all(same_bytes(a, b) for a, b in zip(got, chunks,
                                                                          strict=True))


def test_layerwise_keys_travel_as_keys(server) -> None:
    base = prompt_keys(150, chunks=2)
    keys = [CacheKey(META, k.chunk_hash, layer) for k in base for layer in range(3)]
    chunks = [chunk_for(k, (2, 16, 2, 8)) for k in keys]
    with server.client() as client:
        assert client.store(keys[:5], chunks[:5]) == 5  # one chunk and 2 of 3 layers
        ends = chunk_ends(base)
        assert client.lookup(keys, ends, keys_per_chunk=3) == ends[0]
        assert client.lookup(keys, ends, lookup_id="lw", keys_per_chunk=3) == ends[0]
        got = client.retrieve(keys, lookup_id="lw", keys_per_chunk=3)
    assert len(got) == 3 and all(same_bytes(a, b) for a, b in zip(got, chunks, strict=False))


def test_lookup_by_hashes_from_another_process(server) -> None:
    keys = prompt_keys(160, chunks=3)
    with server.client() as client:
        client.store(keys[:2], [chunk_for(k) for k in keys[:2]])
        hashes = [k.chunk_hash for k in keys]
        assert client.lookup_hashes(META, hashes, chunk_ends(keys)) == chunk_ends(keys)[1]
        assert client.lookup_hashes(META, hashes, chunk_ends(keys), lookup_id="h") == \
            chunk_ends(keys)[1]
        assert len(client.retrieve(lookup_id="h")) == 2


def test_a_lease_given_back_is_released_without_another_request(server) -> None:
    """The client's heartbeat sends a release that no request of its session
    carried; a request's ``released`` releases the leases it names, each by its
    handle and the request it was lent to, and skips any other."""
    keys = prompt_keys(130, chunks=3)
    with server.client() as client, server.client() as watcher:
        client.store(keys, [chunk_for(k) for k in keys])
        assert len(client.retrieve(keys)) == 3
        # Only the heartbeat speaks for ``client`` from here on.
        assert wait_for(lambda: watcher.stats().server.leased_chunks == 0, timeout_s=5)
        client._heartbeat.close()  # and from here on only its requests
        assert len(client.retrieve(keys)) == 3
        assert len(client.releases) == 1
        assert watcher.stats().server.leased_chunks == 3  # given back, not told yet
        (handle, req_id), = client.releases.take().items()
        # A handle named with another request (an id of an earlier server run: ids
        # start again) is not released; nor is one the session does not hold.
        for wrong in ([(handle, req_id + 1)], [(999_999, req_id)]):
            assert client._call(p.Ping(released=wrong), p.PingReply) is not None
            assert watcher.stats().server.leased_chunks == 3
        assert client._call(p.Ping(released=[(handle, req_id)]), p.PingReply) is not None
        assert client.counters.error_replies == 0
        assert watcher.stats().server.leased_chunks == 0
