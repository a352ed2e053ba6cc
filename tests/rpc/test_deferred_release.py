"""A lease given back rides on the session's next request (``released``): no
message of its own on the thread that loads. When the request that carries it
fails before any reply shows the server read it, the lease's request is named
as abandoned, so the server lets go of it without waiting for its timeout.

The channel is stubbed (no server): the test decides which requests fail. The
heartbeat's own sending of releases no request carried is tested against a
real server (tests/server/test_transfer.py)."""

from __future__ import annotations

import pytest

from lmkv.rpc import protocol as p
from lmkv.rpc.channel import Failure
from lmkv.rpc.client import ServerClient
from lmkv.rpc.heartbeat import Releases


def _info(protocol: int = p.PROTOCOL_VERSION) -> p.PingReply:
    return p.PingReply(req_id=0, server_id="s", protocol=protocol, pid=1, host_id="",
                       shm_name="", shm_size=0, max_request_bytes=1, session_timeout_s=30,
                       handle_ttl_s=30)


@pytest.fixture
def client(tmp_path):
    made = ServerClient(f"ipc://{tmp_path}/none/sock", timeout_ms=50)
    made._heartbeat.close()  # (its thread would carry the releases too)
    made.info = _info()
    sent: list[p.Request] = []
    yield made, sent
    made.close()


def _lease(req_id: int, handle: int) -> p.RetrieveReply:
    return p.RetrieveReply(req_id=req_id, server_id="s", handle=handle, data_path="shm",
                           shm_name="", chunks=[])


def _answering(sent: list[p.Request], result):  # type: ignore[no-untyped-def]
    def request(message: p.Request, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(message)
        return result
    return request


def test_a_release_rides_on_the_next_request(client) -> None:
    made, sent = client
    made._release(_lease(40, 6))
    made._release(_lease(41, 7))
    made._channel.request = _answering(sent, (_info(), []))  # type: ignore[method-assign]
    assert made._call(p.Ping(), p.PingReply) is not None
    assert sent[0].released == [(6, 40), (7, 41)]
    made._call(p.Ping(), p.PingReply)
    assert sent[1].released == []  # carried once
    assert not made._heartbeat._abandoned


def test_a_release_lost_with_its_request_is_named_abandoned(client) -> None:
    made, sent = client
    made._release(_lease(41, 7))
    made._channel.request = _answering(sent, Failure.TIMEOUT)  # type: ignore[method-assign]
    assert made._call(p.Ping(), p.PingReply) is None
    assert sent[0].released == [(7, 41)]
    assert 41 in made._heartbeat._abandoned


def test_clients_of_one_session_share_their_releases(client, tmp_path) -> None:
    """An engine's lookup connection carries what its load connection gave back."""
    made, sent = client
    other = ServerClient(f"ipc://{tmp_path}/none/sock", session=made.session, timeout_ms=50,
                         releases=made.releases)
    try:
        other._heartbeat.close()
        other.info = _info()
        made._release(_lease(43, 9))
        other._channel.request = _answering(sent, Failure.UNREACHABLE)  # type: ignore[method-assign]
        other._call(p.Ping(), p.PingReply)
        assert sent[0].released == [(9, 43)]
        assert 43 in other._heartbeat._abandoned
    finally:
        other.close()


def test_releases_are_taken_at_most_a_request_s_worth_at_a_time() -> None:
    releases = Releases()
    for handle in range(p.MAX_RELEASED + 5):
        releases.add(handle, handle)
    assert len(releases.take()) == p.MAX_RELEASED
    assert list(releases.take()) == list(range(p.MAX_RELEASED, p.MAX_RELEASED + 5))
    assert not releases.take() and releases.since == float("inf")


def test_a_server_before_released_is_told_by_abandoning_the_request(client) -> None:
    made, _ = client
    made.info = _info(protocol=1)
    made._release(_lease(44, 10))
    assert not made.releases  # nothing rides on a request such a server skips
    assert 44 in made._heartbeat._abandoned  # the heartbeat names it: released


def test_a_refused_request_s_releases_are_named_abandoned(client) -> None:
    """A request the server refuses may have been refused before its releases were
    read (too large, undecodable): they are named as abandoned too."""
    made, sent = client
    made._release(_lease(45, 11))
    refusal = p.ErrorReply(req_id=0, server_id="s", code=p.TOO_LARGE, reason="too large")
    made._channel.request = _answering(sent, (refusal, []))  # type: ignore[method-assign]
    assert made._call(p.Ping(), p.PingReply) is None
    assert sent[0].released == [(11, 45)]
    assert 45 in made._heartbeat._abandoned
