"""The scheduler's client against a peer that answers what it likes: every answer
is checked against the request it answers, the request's token first. Real
sockets: the test binds the two workers' request sockets and pushes answers to
the client; a forger connects a socket of its own to the client's response
socket, as anyone who can reach it can."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import zmq

from lmkv.lookup import LookupClient, LookupEndpoints, LookupResponse
from lmkv.lookup.messages import LookupCleanup, LookupRequest, decode, encode
from tests.lookup.conftest import CHUNK, poll_result, prompt, wait_for


class Workers:
    """Two 'workers' by hand: they receive the client's messages and answer as told."""

    def __init__(self, endpoints: LookupEndpoints) -> None:
        self.context = zmq.Context()
        self.inboxes = []
        for endpoint in endpoints.requests:
            sock = self.context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            self.inboxes.append(sock)
        self.out = self.context.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(endpoints.responses)
        self.tokens: dict[str, bytes] = {}  # what each request carried (to every rank)

    def received(self, rank: int) -> LookupRequest | LookupCleanup:
        assert self.inboxes[rank].poll(15_000), f"rank {rank} received nothing"
        message = decode(self.inboxes[rank].recv())
        if isinstance(message, LookupRequest):
            self.tokens[message.lookup_id] = message.token
        return message

    def answer(self, lookup_id: str, hits: int, rank: int) -> None:
        """Answer as a worker that received the request does: with its token."""
        self.out.send(encode(LookupResponse(lookup_id, hits, rank,
                                            self.tokens.get(lookup_id, b""))))

    def close(self) -> None:
        for sock in (*self.inboxes, self.out):
            sock.close()
        self.context.term()


@pytest.fixture
def endpoints() -> Iterator[LookupEndpoints]:
    with tempfile.TemporaryDirectory(prefix="lmkv-", dir="/tmp") as runtime_dir:
        yield LookupEndpoints.ipc("spoof", 2, runtime_dir)


@pytest.fixture
def client(endpoints: LookupEndpoints) -> Iterator[LookupClient]:
    with LookupClient(endpoints, chunk_size=CHUNK, timeout_ms=30_000) as client:
        yield client


@pytest.fixture
def workers(endpoints: LookupEndpoints, client: LookupClient) -> Iterator[Workers]:
    workers = Workers(endpoints)
    yield workers
    workers.close()


def test_spoofed_answers_are_dropped_and_the_true_minimum_stands(client, workers) -> None:
    client.lookup("a", prompt(1, 4))  # offsets 32, 64, 96, 128
    request = workers.received(0)
    assert isinstance(request, LookupRequest) and request.offsets[-1] == 4 * CHUNK
    workers.answer("a", 10_000, 0)  # more than the prompt
    workers.answer("a", CHUNK + 5, 0)  # not on a chunk boundary
    workers.answer("a", CHUNK, 2)  # no rank 2 in a channel of two
    workers.answer("never-sent", CHUNK, 0)  # a lookup this client never sent
    workers.answer("a", 2 * CHUNK, 0)  # rank 0's true answer
    workers.answer("a", 0, 0)  # rank 0 again: would drag the minimum to 0
    wait_for(lambda: client.stats()["invalid_answers"] == 4
             and client.stats()["unexpected_answers"] == 1, "the client to drop them")
    assert client.poll("a", wait_s=0) is None  # rank 1 has not answered: still pending
    workers.answer("a", 3 * CHUNK, 1)
    assert poll_result(client, "a") == 2 * CHUNK
    stats = client.stats()
    assert stats["completed"] == 1 and stats["invalid_answers"] == 4


def test_answers_owed_after_a_cancel_are_checked_too(client, workers) -> None:
    client.lookup("c", prompt(2, 2))
    workers.received(0)
    client.cancel("c")  # both ranks owe their answer
    assert client.stats()["owed"] == 1
    workers.answer("c", CHUNK, 0)  # owed: taken (and a cleanup sent)
    workers.answer("c", 0, 0)  # rank 0 owes nothing more
    workers.answer("c", 0, 7)  # no such rank
    wait_for(lambda: client.stats()["invalid_answers"] == 2, "the client to drop them")
    assert client.stats()["late_answers"] == 1 and client.stats()["owed"] == 1
    workers.answer("c", 2 * CHUNK, 1)
    wait_for(lambda: client.stats()["owed"] == 0, "rank 1's late answer")
    assert client.stats()["late_answers"] == 2
    assert client.poll("c") == 0


def test_a_prompt_over_the_maximum_length_is_a_miss_without_asking(endpoints) -> None:
    with LookupClient(endpoints, chunk_size=CHUNK, max_tokens=4 * CHUNK) as client:
        workers = Workers(endpoints)
        try:
            client.lookup("long", prompt(3, 5))
            assert client.poll("long") == 0
            assert client.stats()["oversize"] == 1
            client.lookup("fits", prompt(3, 4))  # the first message the workers see
            assert isinstance(workers.received(0), LookupRequest)
        finally:
            workers.close()


def test_a_frame_too_large_for_an_answer_never_reaches_the_client(client, workers) -> None:
    client.lookup("f", prompt(4, 1))
    workers.received(0)
    flooder = workers.context.socket(zmq.PUSH)  # its connection is cut: its own socket
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect(client.response_endpoint)
    flooder.send(b"\x00" * (1 << 20))
    workers.answer("f", CHUNK, 0)
    workers.answer("f", CHUNK, 1)
    assert poll_result(client, "f") == CHUNK
    assert client.stats()["rejected_messages"] == 0  # dropped by ZMQ, never decoded
    flooder.close()


def test_a_plausible_answer_without_the_requests_token_is_never_taken(client, workers,
                                                                        endpoints) -> None:
    client.lookup("v", prompt(5, 4))  # offsets 32, 64, 96, 128
    request = workers.received(0)
    assert isinstance(request, LookupRequest) and len(request.token) == 16
    forger = workers.context.socket(zmq.PUSH)  # anyone who can reach the socket
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(endpoints.responses)
    try:
        # Right id, right ranks, chunk boundaries, first to arrive: all they lack is
        # the token, which only the workers received.
        for rank in (0, 1):
            for token in (b"", os.urandom(16), request.token[:8]):
                forger.send(encode(LookupResponse("v", CHUNK, rank, token)))
        wait_for(lambda: client.stats()["invalid_answers"] == 6, "the client to drop them")
        assert client.poll("v", wait_s=0) is None  # still waiting for the workers
        workers.answer("v", 4 * CHUNK, 0)
        workers.answer("v", 4 * CHUNK, 1)
        assert poll_result(client, "v") == 4 * CHUNK
        assert client.stats()["completed"] == 1
    finally:
        forger.close()


def test_every_lookup_gets_a_token_of_its_own(client, workers) -> None:
    client.lookup("t1", prompt(6, 1))
    client.lookup("t2", prompt(6, 1))  # the same prompt
    first, second = workers.received(0), workers.received(0)
    assert first.token and second.token and first.token != second.token
    workers.answer("t2", CHUNK, 0)
    workers.tokens["t2"] = first.token  # an answer to t2 that carries t1's token
    workers.answer("t2", CHUNK, 1)
    wait_for(lambda: client.stats()["invalid_answers"] == 1, "the client to drop it")
    assert client.poll("t2", wait_s=0) is None
