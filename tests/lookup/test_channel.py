"""The lookup channel end to end: a client in this process, two worker processes."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from lmkv.keys.chunking import prefix_hashes
from lmkv.lookup import LookupRequest, LookupResponse
from lmkv.lookup.messages import encode
from tests.lookup.conftest import CHUNK, poll_result, prompt, wait_for

pytestmark = pytest.mark.slow  # worker processes


def store(workers, tokens_by_rank) -> None:
    for worker, tokens in zip(workers, tokens_by_rank, strict=True):
        assert worker.call("store", tokens) == len(tokens)


def test_the_minimum_over_the_workers_wins(workers, make_client) -> None:
    tokens = prompt(1, 6)
    store(workers, [tokens[:4 * CHUNK], tokens[:2 * CHUNK]])
    client = make_client()
    client.lookup("min", tokens)
    assert poll_result(client, "min") == 2 * CHUNK
    assert client.poll("min") == 2 * CHUNK  # a finished result stays pollable
    client.cancel("min")  # not retrieved: the workers release what they prefetched
    assert client.poll("min") == 0


def test_a_full_miss_answers_zero_from_the_workers(workers, make_client) -> None:
    client = make_client()
    served = [w.state()["responders"][0]["requests"] for w in workers]
    client.lookup("miss", prompt(2, 3))
    assert poll_result(client, "miss") == 0
    stats = client.stats()
    assert stats["completed"] == 1 and stats["timeouts"] == 0  # answered, not timed out
    assert [w.state()["responders"][0]["requests"] for w in workers] == [n + 1 for n in served]


def test_a_prompt_shorter_than_a_chunk_is_answered_without_asking(workers, make_client) -> None:
    client = make_client()
    client.lookup("short", list(range(CHUNK - 1)))
    assert client.poll("short") == 0
    assert client.stats()["completed"] == 0


def test_poll_is_minus_one_unknown_none_pending_then_the_count(workers, make_client) -> None:
    tokens = prompt(3, 3)
    store(workers, [tokens, tokens])
    client = make_client(backoff_ms=5)
    assert client.poll("never-started") == -1
    with workers[1].stopped():
        client.lookup("pending", tokens)
        assert client.poll("pending") is None  # rank 1 cannot answer while stopped
        assert client.poll("pending") is None
    assert poll_result(client, "pending") == 3 * CHUNK
    for worker in workers:
        assert worker.call("retrieve", tokens, "pending") == 3 * CHUNK


def test_a_timed_out_lookup_answers_zero_and_its_cleanup_releases_everything(
        workers, make_client) -> None:
    tokens = prompt(4, 4)
    store(workers, [tokens, tokens])
    hits_before = [w.state()["tier_hits"] for w in workers]
    client = make_client(timeout_ms=300)
    with workers[1].stopped():
        client.lookup("slow", tokens)
        assert poll_result(client, "slow") == 0
        assert client.stats()["timeouts"] == 1
        assert client.poll("slow") == 0  # again, and after a cancel: 0, never an exception
        client.cancel("slow")
        assert client.poll("slow") == 0
        client.lookup("slow", tokens)  # rank 1 still owes an answer: the id is not reused
        assert client.poll("slow") == 0
        assert client.stats()["reused_while_owed"] == 1
    # rank 1 wakes up, prefetches, answers late and is told to clean up
    wait_for(lambda: client.stats()["owed"] == 0, "the late answers")
    assert client.stats()["late_answers"] >= 1  # rank 0's too when it came after the timeout
    for worker, before in zip(workers, hits_before, strict=True):
        wait_for(worker.is_clean, f"rank {worker.rank} to release the lookup")
        state = worker.state()
        assert state["tier_hits"] == before + 4  # it did prefetch all 4 chunks ...
        assert state["responders"][0]["cleanups"] >= 1  # ... and released them on a cleanup
        assert state["pins"] == 0 and state["extra_refs"] == 0
    assert client.poll("slow") == 0
    client.lookup("slow", tokens)  # nothing owed any more: the id works again
    assert poll_result(client, "slow") == 4 * CHUNK
    client.cancel("slow")


def test_a_cancelled_lookup_is_released_on_every_worker(workers, make_client) -> None:
    tokens = prompt(5, 2)
    store(workers, [tokens, tokens])
    client = make_client()
    client.lookup("cancel", tokens)
    client.cancel("cancel")
    assert client.poll("cancel") == 0
    wait_for(lambda: client.stats()["owed"] == 0, "the answers to the cancelled lookup")
    # the make_client fixture then checks every pin and reference was released


def test_retrieve_consumes_the_prefetched_chunks(workers, make_client) -> None:
    tokens = prompt(6, 3)
    store(workers, [tokens, tokens])
    client = make_client()
    client.lookup("load", tokens)
    assert poll_result(client, "load") == 3 * CHUNK
    before = [w.state()["tier_hits"] for w in workers]
    for worker in workers:
        assert worker.call("retrieve", tokens, "load") == 3 * CHUNK
    assert [w.state()["tier_hits"] for w in workers] == before  # no second read of the tier
    assert workers[0].call("retrieve", tokens, None) == 3 * CHUNK  # without a lookup: it reads
    assert workers[0].state()["tier_hits"] == before[0] + 3


def test_the_tcp_transport(workers, make_client) -> None:
    tokens = prompt(7, 5)
    store(workers, [tokens[:3 * CHUNK], tokens])
    client = make_client("tcp")
    assert client.response_endpoint.startswith("tcp://127.0.0.1:")
    client.lookup("tcp", tokens)
    assert poll_result(client, "tcp") == 3 * CHUNK
    client.cancel("tcp")


def test_garbage_messages_are_rejected_and_the_worker_keeps_serving(workers, make_client) -> None:
    tokens = prompt(8, 2)
    store(workers, [tokens, tokens])
    request = encode(LookupRequest("g", prefix_hashes(tokens, CHUNK), [CHUNK, 2 * CHUNK]))
    messages = [
        [b""],
        [b"\xc1 not msgpack"],
        [request[:len(request) // 2]],  # truncated
        [request + b"\x00"],  # trailing bytes
        [msgspec.msgpack.encode({"type": "LookupRequest", "lookup_id": "g", "hashes": [b"x"],
                                 "offsets": [3, 2]})],  # inconsistent
        [msgspec.msgpack.encode({"type": "Hello", "lookup_id": "g"})],  # foreign
        [encode(LookupResponse("g", 5, 0))],  # a message for the other direction
        [request, request],  # two parts
    ]
    rank0 = workers[0]
    rejected = rank0.state()["responders"][0]["rejected_messages"]
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rank0.ipc)
    try:
        for message in messages:
            sock.send_multipart(message)
        wait_for(lambda: rank0.state()["responders"][0]["rejected_messages"]
                 == rejected + len(messages),
                 "the worker to reject every bad message")
    finally:
        sock.close()
        context.term()
    assert rank0.process.is_alive()
    client = make_client()
    client.lookup("after-garbage", tokens)
    assert poll_result(client, "after-garbage") == 2 * CHUNK
    client.cancel("after-garbage")


def test_garbage_and_stray_answers_do_not_disturb_the_client(workers, make_client) -> None:
    tokens = prompt(9, 1)
    store(workers, [tokens, tokens])
    client = make_client()
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client.response_endpoint)
    try:
        sock.send(b"\x93garbage")
        sock.send(encode(LookupResponse("nobody-asked", 7, 0)))
        wait_for(lambda: client.stats()["rejected_messages"] == 1
                 and client.stats()["unexpected_answers"] == 1, "the client to drop both")
    finally:
        sock.close()
        context.term()
    client.lookup("after", tokens)
    assert poll_result(client, "after") == CHUNK
    client.cancel("after")


def test_block_granular_lookups_hit_inside_a_chunk(workers, make_client) -> None:
    tokens = prompt(41, 3)
    store(workers, [tokens, tokens])
    diverging = [*tokens[:CHUNK + 13], *range(7, 7 + 40)]
    blocks = make_client(block_size=8)
    blocks.lookup("blocks", diverging)
    assert poll_result(blocks, "blocks") == CHUNK + 8  # the chunk, then one whole block
    for worker in workers:
        assert worker.call("retrieve", diverging[:CHUNK + 8], "blocks") == CHUNK + 8
    blocks.close()  # one client binds the answers' endpoint at a time
    chunks = make_client()  # an older scheduler: whole chunks only
    chunks.lookup("chunks", diverging)
    assert poll_result(chunks, "chunks") == CHUNK
    chunks.cancel("chunks")
