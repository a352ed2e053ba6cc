"""Client behaviour that needs no second process: one worker served in this process."""

from __future__ import annotations

import threading

import pytest
import zmq

import lmkv.lookup.sockets
from lmkv.lookup import LookupClient
from tests.lookup.conftest import CHUNK, poll_result, prompt, wait_for
from tests.lookup.worker_proc import hf_kv


def test_a_pending_id_is_not_asked_twice_and_results_are_kept_up_to_a_bound(
        engine, endpoints, responder, monkeypatch) -> None:
    tokens = prompt(1, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    # The worker holds its answer until both asks are made, so "a" is still
    # pending at the second (an answer in between would make it a new lookup).
    asked_twice = threading.Event()
    prefetch = engine.lookup_and_prefetch_hashes

    def held(*args, **kwargs):
        assert asked_twice.wait(15), "the test never made its second ask"
        return prefetch(*args, **kwargs)

    monkeypatch.setattr(engine, "lookup_and_prefetch_hashes", held)
    with LookupClient(endpoints, chunk_size=CHUNK, results_kept=2,
                      local_calls=False) as client:
        client.lookup("a", tokens)
        client.lookup("a", tokens)
        asked_twice.set()
        assert poll_result(client, "a") == 2 * CHUNK
        assert client.stats()["lookups"] == 1  # the second ask sent nothing
        assert responder.stats()["requests"] == 1
        for lookup_id in ("b", "c"):
            client.lookup(lookup_id, tokens[:CHUNK])
            assert poll_result(client, lookup_id) == CHUNK
        assert client.poll("a") == -1  # the oldest result was forgotten
        assert client.poll("c") == CHUNK
        for lookup_id in ("a", "b", "c"):
            engine.release_lookup(lookup_id)


def test_close_is_prompt_with_a_pending_lookup_and_a_silent_worker(endpoints) -> None:
    context = zmq.Context()
    silent = context.socket(zmq.PULL)  # bound, never read: a stalled worker
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(endpoints.requests[0])
    try:
        client = LookupClient(endpoints, chunk_size=CHUNK)
        client.lookup("closing", prompt(1, 1))
        assert client.poll("closing") is None
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive()
        assert client.poll("closing") == 0
        with pytest.raises(RuntimeError, match="closed"):
            client.lookup("later", prompt(1, 1))
    finally:
        silent.close()
        context.term()


def test_cancel_of_an_unknown_id_and_polls_after_close_never_raise(endpoints) -> None:
    client = LookupClient(endpoints, chunk_size=CHUNK)
    client.cancel("nobody")
    client.close()
    client.close()
    client.cancel("nobody")
    assert client.poll("nobody") == -1


def test_a_worker_whose_queue_is_full_makes_the_lookup_a_miss(
        monkeypatch: pytest.MonkeyPatch, endpoints) -> None:
    monkeypatch.setattr(lmkv.lookup.sockets, "SEND_HWM", 1)
    with LookupClient(endpoints, chunk_size=CHUNK) as client:  # no worker serves
        results = []
        for i in range(8):
            client.lookup(f"q{i}", prompt(i, 1))
            results.append(client.poll(f"q{i}"))
        assert client.stats()["failed_sends"] > 0
        assert 0 in results  # refused at once, not after the timeout


def test_a_lookup_nobody_polls_is_cancelled_at_its_deadline(endpoints) -> None:
    with LookupClient(endpoints, chunk_size=CHUNK, timeout_ms=50) as client:  # no worker
        client.lookup("unpolled", prompt(1, 1))
        wait_for(lambda: client.stats()["timeouts"] == 1, "the sweep to cancel it")
        assert client.stats()["owed"] == 1
        assert client.poll("unpolled") == 0


@pytest.mark.parametrize("settings,message", [
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"backoff_ms": -1}, "backoff_ms"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"results_kept": 0}, "results_kept"),
])
def test_bad_settings_are_refused(endpoints, settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        LookupClient(endpoints, **settings)


def test_from_config_takes_the_chunking_and_the_transport(endpoints) -> None:
    from lmkv import load_config

    runtime_dir = endpoints.responses[len("ipc://"):].rsplit("/", 1)[0]
    config = load_config(env={}, overrides={"lmkv.chunk_size": 64,
                                            "lmkv.save_partial_chunk": True})
    with LookupClient.from_config(config, engine_id="cfg", world_size=1,
                                  runtime_dir=runtime_dir, timeout_ms=5) as client:
        assert (client.chunk_size, client.save_partial_chunk) == (64, True)
        assert client.timeout_s == 0.005
        assert client.response_endpoint.endswith("/lmkv-lookup-cfg-responses.sock")
    with pytest.raises(ValueError, match=r"^transport: Input should be 'ipc' or 'tcp'$"):
        LookupClient.from_config(config, engine_id="cfg", world_size=1, transport="udp")
    with pytest.raises(ValueError, match="needs base_port"):
        LookupClient.from_config(config, engine_id="cfg", world_size=1, transport="tcp")
