"""A lease is released one way: when the socket it went out on fails before any
reply shows the server read it, its request is named as abandoned, so the
server lets go of the lease without waiting for its timeout.

The channel is stubbed (no server): the test decides which requests fail."""

from __future__ import annotations

import pytest

from lmkv.rpc import protocol as p
from lmkv.rpc.channel import Failure
from lmkv.rpc.client import ServerClient


@pytest.fixture
def client(tmp_path):
    made = ServerClient(f"ipc://{tmp_path}/none/sock", timeout_ms=50)
    sent: list[p.Request] = []

    def send(message: p.Request) -> bool:
        sent.append(message)
        return True

    made._channel.send = send  # type: ignore[method-assign]
    made._channel.down = False
    yield made, sent
    made.close()


def _lease(req_id: int, handle: int) -> p.RetrieveReply:
    return p.RetrieveReply(req_id=req_id, server_id="s", handle=handle, data_path="shm",
                           shm_name="", chunks=[])


def test_a_release_lost_with_its_socket_is_named_abandoned(client) -> None:
    made, sent = client
    made._release(_lease(41, 7))
    assert [m.handle for m in sent] == [7]
    made._channel.request = lambda *a, **k: Failure.TIMEOUT  # type: ignore[method-assign]
    assert made._call(p.Ping(), p.PingReply) is None
    assert 41 in made._heartbeat._abandoned


def test_a_reply_after_the_release_shows_it_arrived(client) -> None:
    made, _ = client
    made._release(_lease(42, 8))
    reply = p.ReleaseReply(req_id=0, server_id="s", released=0)
    made._channel.request = lambda *a, **k: (reply, [])  # type: ignore[method-assign]
    assert made._call(p.Release(lookup_id="x"), p.ReleaseReply) is not None
    made._channel.request = lambda *a, **k: Failure.TIMEOUT  # type: ignore[method-assign]
    made._call(p.Ping(), p.PingReply)
    assert 42 not in made._heartbeat._abandoned
