"""The scheduler's client against a peer that answers what it likes:
every answer is checked against the request it answers. Real sockets: the test
binds the two workers' request sockets and pushes answers to the client."""

from __future__ import annotations

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

    def received(self, rank: int) -> LookupRequest | LookupCleanup:
        assert self.inboxes[rank].poll(15_000), f"rank {rank} received nothing"
        return decode(self.inboxes[rank].recv())

    def answer(self, lookup_id: str, hits: int, rank: int) -> None:
        self.out.send(encode(LookupResponse(lookup_id, hits, rank)))

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
