"""A forger on a tcp lookup channel without CURVE (every local user can reach the
client's response port) answers first, with plausible answers; the real worker
processes answer later. Only the workers' answers count."""

from __future__ import annotations

import contextlib

import pytest
import zmq

from lmkv.lookup import LookupResponse
from lmkv.lookup.messages import encode
from tests.lookup.conftest import CHUNK, poll_result, prompt, wait_for

pytestmark = pytest.mark.slow  # real worker processes


def test_answers_from_anyone_but_the_workers_are_never_taken(workers, make_client) -> None:
    tokens = prompt(40, 4)
    for worker in workers:
        assert worker.call("store", tokens) == len(tokens)
    client = make_client("tcp")
    context = zmq.Context()
    forger = context.socket(zmq.PUSH)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(client.response_endpoint)
    try:
        with workers[0].stopped(), workers[1].stopped():
            client.lookup("victim", tokens)
            for _ in range(11):  # a chunk boundary, from each rank, many times
                for rank in (0, 1):
                    forger.send(encode(LookupResponse("victim", CHUNK, rank)))
            wait_for(lambda: client.stats()["invalid_answers"] == 22,
                     "the client to drop the forged answers")
            assert client.poll("victim", wait_s=0) is None
        assert poll_result(client, "victim") == 4 * CHUNK  # the workers' answer
        assert client.stats()["completed"] == 1
        for worker in workers:
            assert worker.call("retrieve", tokens, "victim") == 4 * CHUNK
    finally:
        forger.close()
        with contextlib.suppress(zmq.ZMQError):
            context.term()
