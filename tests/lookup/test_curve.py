"""The lookup channel over tcp with CURVE: the scheduler and its worker share a key pair;
a peer without it can neither answer lookups nor ask them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmkv.config.model import load_config
from lmkv.keys.chunking import prefix_hashes
from lmkv.lookup import LookupClient, LookupEndpoints, LookupResponder
from lmkv.lookup.messages import LookupRequest, LookupResponse, encode
from lmkv.lookup.sockets import last_endpoint
from tests.lookup.conftest import CHUNK, free_ports, poll_result, prompt, wait_for

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class GatedEngine:
    """Answers each lookup with the hit count the test releases (so a forged answer
    has time to arrive first)."""

    def __init__(self) -> None:
        self.config = load_config(env={})  # the lookup bounds come from it
        self.futures: dict[str, Future] = {}
        self.asked: list[str] = []
        self.lock = threading.Lock()

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: list[bytes],
                                   chunk_ends: list[int]) -> Future:
        future: Future = Future()
        with self.lock:
            self.asked.append(lookup_id)
            self.futures[lookup_id] = future
        return future

    def release_lookup(self, lookup_id: str) -> None:
        pass


def curve_config(tmp: Path, secret: str, **lookup) -> dict:
    return {"chunk_size": CHUNK, "lookup": {"transport": "tcp", "base_port": free_ports(2), "curve":
                       {"secret_key": secret}, **lookup}}


@pytest.fixture
def channel(tmp_path) -> Iterator[tuple[LookupClient, LookupResponder, GatedEngine]]:
    from lmkv.rpc.auth import write_keypair

    _, secret = write_keypair(tmp_path / "keys", "engine")
    config = load_config(overrides=curve_config(tmp_path, str(secret)))
    endpoints = LookupEndpoints.from_config(config.lookup, "curve", 1)
    assert endpoints.curve is not None
    engine = GatedEngine()
    responder = LookupResponder.for_rank(engine, endpoints, 0)
    client = LookupClient.from_config(config, engine_id="curve", world_size=1,
                                      timeout_ms=30_000)
    yield client, responder, engine
    client.close()
    responder.close()


def rogue_push(endpoint: str, keys: tuple[bytes, bytes] | None, responder_key: bytes | None
               ) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = responder_key
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    return ctx, sock, monitor


def handshake_failed(monitor: zmq.Socket) -> bool:
    assert monitor.poll(15_000), "no handshake event"
    return bool(recv_monitor_message(monitor)["event"] & HANDSHAKE_FAILED)


def test_lookups_work_over_curve(channel) -> None:
    client, _server, engine = channel
    client.lookup("ok", prompt(1, 3))
    wait_for(lambda: "ok" in engine.futures, "the worker to be asked")
    engine.futures["ok"].set_result(2 * CHUNK)
    assert poll_result(client, "ok") == 2 * CHUNK


@pytest.mark.parametrize("who", ["no keys", "unauthorized key"])
def test_an_outsider_cannot_answer_a_lookup(channel, who) -> None:
    client, _, engine = channel
    tokens = prompt(2, 4)
    client.lookup("victim", tokens)
    wait_for(lambda: "victim" in engine.futures, "the worker to be asked")
    keys = None if who == "no keys" else zmq.curve_keypair()
    responder_key = client.endpoints.curve.public  # the real responder key: only ours is wrong
    ctx, sock, monitor = rogue_push(client.response_endpoint, keys, responder_key)
    try:
        assert handshake_failed(monitor)
        forged = encode(LookupResponse("victim", 4 * CHUNK, rank=0))
        for _ in range(10):
            with contextlib.suppress(zmq.Again):  # nothing connected: nothing delivered
                sock.send(forged, zmq.NOBLOCK)
        assert client.poll("victim") is None  # still waiting for the real worker
        engine.futures["victim"].set_result(CHUNK)
        assert poll_result(client, "victim") == CHUNK
    finally:
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_an_outsider_cannot_ask_a_worker(channel) -> None:
    client, responder, engine = channel
    ctx, sock, monitor = rogue_push(last_endpoint(responder._requests), zmq.curve_keypair(),
                                    client.endpoints.curve.public)
    try:
        assert handshake_failed(monitor)
        hashes = prefix_hashes(prompt(3, 2), CHUNK)
        for _ in range(10):
            with contextlib.suppress(zmq.Again):
                sock.send(encode(LookupRequest("intruder", hashes, [CHUNK, 2 * CHUNK])),
                          zmq.NOBLOCK)
        client.lookup("after", prompt(4, 1))  # a real request, queued behind any forged
        wait_for(lambda: "after" in engine.asked, "the worker to be asked")
        assert engine.asked == ["after"]
        engine.futures["after"].set_result(CHUNK)
        assert poll_result(client, "after") == CHUNK
    finally:
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_a_channel_key_that_others_can_read_is_refused(tmp_path) -> None:
    from lmkv.rpc.auth import AuthError, write_keypair

    _, secret = write_keypair(tmp_path, "engine")
    secret.chmod(0o644)
    config = load_config(overrides=curve_config(tmp_path, str(secret)))
    with pytest.raises(AuthError, match="mode 0644"):
        LookupEndpoints.from_config(config.lookup, "curve", 1)
