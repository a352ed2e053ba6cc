"""The client's heartbeat against a real server: a renewal that crosses the caller's
own release is no loss (the interleaving is forced, not hoped for), a handle the
server really expired is reported, and short transfers send no renewal at all."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from lmkv.base.logutil import RateLimitedLog
from lmkv.rpc import heartbeat
from lmkv.rpc import protocol as p
from lmkv.rpc.channel import Channel
from tests.server.procs import ServerProcess, chunk_for, prompt_keys, start_server, wait_for

pytestmark = pytest.mark.slow  # real lmkv server processes

LOST = "no longer holds"


@pytest.fixture(scope="module")
def short_ttl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Handles live 0.4 s: a client's heartbeat renews every 0.1 s."""
    srv = start_server(tmp_path_factory.mktemp("heartbeat"), None, "--handle-ttl", "0.4",
                       name="heartbeat")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def renewals(monkeypatch: pytest.MonkeyPatch) -> Iterator[RenewGate]:
    gate = RenewGate()
    monkeypatch.setattr(Channel, "request",
                        lambda channel, *args, **kwargs: gate.request(channel, *args, **kwargs))
    # A fresh rate limit: what an earlier test logged must not hide this test's line.
    monkeypatch.setattr(heartbeat, "_log", RateLimitedLog(heartbeat.logger))
    yield gate
    gate.proceed.set()  # never leave the heartbeat thread waiting


class RenewGate:
    """Holds the heartbeat's first renewal until the test lets it go, and keeps the
    server's reply to it. Only the heartbeat sends ``renew``: the caller's own
    requests pass straight through."""

    original = Channel.request

    def __init__(self) -> None:
        self.sending = threading.Event()
        self.proceed = threading.Event()
        self.replies: list[p.RenewReply] = []
        self.sent: list[list[int]] = []

    def request(self, channel: Channel, message: p.Request, parts=(), timeout_ms: int = 500):
        if not isinstance(message, p.Renew):
            return RenewGate.original(channel, message, parts, timeout_ms)
        if message.handles and not self.sending.is_set():
            self.sending.set()
            assert self.proceed.wait(30), "the test never let the renewal go"
        result = RenewGate.original(channel, message, parts, timeout_ms)
        self.sent.append(list(message.handles))
        if isinstance(result, tuple) and isinstance(result[0], p.RenewReply):
            self.replies.append(result[0])
        return result


def store_prompt(srv: ServerProcess, prompt: int) -> list:
    keys = prompt_keys(prompt)
    with srv.client() as client:
        assert client.store(keys, [chunk_for(k) for k in keys]) == len(keys)
    return keys


def test_a_renewal_crossing_the_callers_release_is_not_reported_lost(
        short_ttl_server, renewals, caplog) -> None:
    keys = store_prompt(short_ttl_server, 1)
    with caplog.at_level(logging.WARNING, logger=heartbeat.__name__), \
            short_ttl_server.client() as client:
        def consume(views: list[torch.Tensor]) -> None:
            # The heartbeat has taken this handle for a renewal and is about to send
            # it; the caller finishes first and releases the handle.
            assert renewals.sending.wait(30), "no renewal was started"

        assert client.retrieve_into(keys, consume) == len(keys)
        client.stats()  # carries the release (lmkv.rpc.heartbeat: given-back leases)
        renewals.proceed.set()  # the renewal reaches the server after the release
        assert wait_for(lambda: renewals.replies, timeout_s=30)
        (reply,) = renewals.replies[:1]
        assert reply.missing == renewals.sent[0]  # the server had released it: crossed
        assert client._heartbeat.lost_handles == 0
        assert client.counters.error_replies == 0
    assert not [r for r in caplog.records if LOST in r.getMessage()]


def test_a_handle_the_server_expired_while_in_use_is_reported(short_ttl_server, renewals,
                                                               caplog) -> None:
    keys = store_prompt(short_ttl_server, 2)
    with short_ttl_server.client() as watcher:
        expired_before = watcher.stats().server.expired_handles
    with caplog.at_level(logging.WARNING, logger=heartbeat.__name__), \
            short_ttl_server.client() as client:
        def consume(views: list[torch.Tensor]) -> None:
            assert renewals.sending.wait(30), "no renewal was started"
            # The renewal is held back until the server has expired the handle.
            with short_ttl_server.client() as watcher:
                assert wait_for(lambda: watcher.stats().server.expired_handles
                                > expired_before, timeout_s=30)
            renewals.proceed.set()
            assert wait_for(lambda: client._heartbeat.lost_handles, timeout_s=30)

        assert client.retrieve_into(keys, consume) == len(keys)
        assert client._heartbeat.lost_handles == 1  # asked once: not renewed again
    lost = [r.getMessage() for r in caplog.records if LOST in r.getMessage()]
    assert lost == ["lmkv client: the server no longer holds 1 of 1 handles in use "
                    "(expired, or the server restarted); their buffers stay quarantined "
                    "until released"]
    with short_ttl_server.client() as watcher:  # the late release ended its quarantine
        assert wait_for(lambda: watcher.stats().server.quarantined_chunks == 0)


def test_transfers_shorter_than_the_interval_send_no_renewal(server, renewals) -> None:
    """The package's server: handles live 30 s, so the heartbeat renews after 7.5 s."""
    keys = store_prompt(server, 3)
    renewals.proceed.set()
    with server.client() as client:
        for _ in range(20):
            assert client.retrieve_into(keys, lambda views: time.sleep(0.02)) == len(keys)
        assert client._heartbeat.renewals == 0
    assert renewals.sent == []
