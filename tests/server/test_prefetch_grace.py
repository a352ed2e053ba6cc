"""A lookup that prefetches without waiting is answered with its hit tokens when
the prefetch finishes within the server's grace (a hit in its memory: a thread
hand-off), else "still loading" at the grace's end, and never twice.

The server runs in this process (a thread), so the test controls when the
prefetch finishes: no timing is asserted."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from lmkv.config.model import load_config
from lmkv.rpc.client import ServerClient
from lmkv.server import service as service_module
from lmkv.server.main import build_storage
from lmkv.server.server import KVServer
from tests.server.procs import chunk_ends, prompt_keys


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A server in a thread whose prefetches finish when the test says: each
    lookup's future is handed to ``started`` (a list) once the server took it."""
    config = load_config(env={}, overrides={
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": 1 << 20,
                                                   "shared_memory": False}}]})
    storage = build_storage(config)
    server = KVServer(storage, endpoint=f"ipc://{tmp_path}/s/sock", max_request_bytes=1 << 20,
                      session_timeout_s=60)
    started: list[Future] = []
    deferred = threading.Event()

    def lookup_and_prefetch(*args, **kwargs) -> Future:
        future: Future = Future()
        started.append(future)
        return future

    monkeypatch.setattr(storage, "lookup_and_prefetch", lookup_and_prefetch)
    real = server._reply_or_defer

    def reply_or_defer(envelope, req_id, result):
        real(envelope, req_id, result)
        if isinstance(result, service_module.Deferred):
            deferred.set()

    monkeypatch.setattr(server, "_reply_or_defer", reply_or_defer)
    address = server.bind()
    loop = threading.Thread(target=server.serve, daemon=True)
    loop.start()
    client = ServerClient(address, timeout_ms=20_000)
    try:
        yield client, started, deferred, server
    finally:
        client.close()
        server.stop()
        loop.join(10)
        server.close(0.0)
        storage.close()


def test_a_prefetch_done_within_the_grace_is_answered_with_its_tokens(served, monkeypatch
                                                                     ) -> None:
    client, started, deferred, _ = served
    monkeypatch.setattr(service_module, "PREFETCH_GRACE_S", 15.0)
    keys = prompt_keys(1)

    def finish_once_deferred() -> None:
        assert deferred.wait(15)
        started[0].set_result(512)

    helper = threading.Thread(target=finish_once_deferred)
    helper.start()
    got = client.start_lookup_hashes(keys[0].meta, [k.chunk_hash for k in keys],
                                     chunk_ends(keys), "warm")
    helper.join(15)
    assert got == 512  # done: no prefetch_status round trip needed


def test_a_prefetch_past_the_grace_is_still_loading_and_answered_once(served, monkeypatch
                                                                     ) -> None:
    client, started, _deferred, server = served
    monkeypatch.setattr(service_module, "PREFETCH_GRACE_S", 0.0)
    sent: list[int] = []
    real_send = server._send
    monkeypatch.setattr(server, "_send", lambda env, req_id, outcome: (
        sent.append(req_id), real_send(env, req_id, outcome)))
    keys = prompt_keys(2)
    got = client.start_lookup_hashes(keys[0].meta, [k.chunk_hash for k in keys],
                                     chunk_ends(keys), "cold")
    assert got is None  # still loading: the client polls prefetch_status
    started[0].set_result(256)  # finishes after its answer went out
    assert client.ping() is not None  # the loop ran the completion meanwhile
    assert len(sent) == len(set(sent)), f"a request answered twice: {sent}"
