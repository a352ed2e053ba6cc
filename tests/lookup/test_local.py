"""A worker served in the client's own process is called, not sent messages
(``lmkv.lookup.local``): answers, cleanups, and what happens when it goes away."""

from __future__ import annotations

import threading

from lmkv.lookup import LookupClient, LookupResponder, local
from lmkv.lookup.messages import LookupResponse
from tests.lookup.conftest import CHUNK, poll_result, prompt
from tests.lookup.worker_proc import hf_kv


def test_a_memory_hit_is_answered_before_lookup_returns_and_its_chunks_are_loaded(
        engine, endpoints, responder) -> None:
    tokens = prompt(1, 3)
    kv = hf_kv(len(tokens))
    engine.store(tokens, kv=kv)
    assert local.find(endpoints.requests[0]) is responder
    with LookupClient(endpoints, chunk_size=CHUNK) as client:
        client.lookup("hit", [*tokens, 7])
        assert client.poll("hit", wait_s=0) == 3 * CHUNK  # no wait: answered by the call
        result = engine.retrieve([*tokens, 7], lookup_id="hit")
        assert result.num_tokens == 3 * CHUNK
        for (k, v), (k0, v0) in zip(result.kv, kv, strict=True):
            assert k.equal(k0[:, :, :3 * CHUNK]) and v.equal(v0[:, :, :3 * CHUNK])
        assert len(engine.storage.events) == 0  # taken: nothing held
        assert responder.stats()["answers"] == 1


def test_a_miss_and_a_cancel_release_what_the_worker_holds(engine, endpoints,
                                                           responder) -> None:
    tokens = prompt(2, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    with LookupClient(endpoints, chunk_size=CHUNK) as client:
        client.lookup("miss", prompt(3, 2))
        assert client.poll("miss", wait_s=0) == 0
        client.lookup("dropped", [*tokens, 1])
        assert client.poll("dropped", wait_s=0) == 2 * CHUNK
        assert len(engine.storage.events) == 1  # the hit's chunks, held for a load
        client.cancel("dropped")  # the request will not be loaded: the cleanup is a call
        assert len(engine.storage.events) == 0
        assert client.stats()["cleanups_sent"] == 2
        assert responder.stats()["cleanups"] == 2
    assert all(pins == 0 for _, pins in engine.storage.tiers[0].entry_refs())


def test_an_answer_from_a_prefetch_thread_comes_back_as_a_call(engine, endpoints,
                                                               responder) -> None:
    tokens = prompt(4, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    gate = threading.Event()
    real = engine.lookup_and_prefetch_hashes
    later: list[threading.Thread] = []

    def slow(*args, **kwargs):  # as a lookup that reads a lower tier on the prefetch threads
        future = real(*args, **kwargs)
        from concurrent.futures import Future
        out: Future = Future()
        thread = threading.Thread(target=lambda: (gate.wait(10), out.set_result(
            future.result())))
        later.append(thread)
        thread.start()
        return out

    engine.lookup_and_prefetch_hashes = slow  # type: ignore[method-assign]
    with LookupClient(endpoints, chunk_size=CHUNK) as client:
        client.lookup("async", [*tokens, 1])
        assert client.poll("async", wait_s=0) is None
        gate.set()
        assert poll_result(client, "async") == 2 * CHUNK
        engine.release_lookup("async")
    for thread in later:
        thread.join(5)


def test_a_forged_answer_is_refused_on_the_call_path_too(engine, endpoints,
                                                         responder) -> None:
    with LookupClient(endpoints, chunk_size=CHUNK) as client:
        responder.ask = lambda request, reply: reply(  # type: ignore[method-assign]
            LookupResponse(request.lookup_id, request.offsets[-1], 0, b"x" * len(request.token)))
        client.lookup("forged", prompt(5, 2))
        assert client.poll("forged", wait_s=0) is None
        assert client.stats()["invalid_answers"] == 1
        client.cancel("forged")


def test_a_failing_worker_call_is_a_miss_and_a_closed_one_is_reached_by_socket(
        engine, endpoints) -> None:
    tokens = prompt(6, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    responder = LookupResponder.for_rank(engine, endpoints, 0)
    with LookupClient(endpoints, chunk_size=CHUNK, timeout_ms=200) as client:
        def broken(request, reply):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug")

        responder.ask = broken  # type: ignore[method-assign]
        client.lookup("broken", [*tokens, 1])
        assert client.poll("broken", wait_s=0) == 0
        assert client.stats()["failed_sends"] == 1
        responder.close()
        assert local.find(endpoints.requests[0]) is None
        client.lookup("gone", [*tokens, 1])  # over the socket now, and nobody serves it
        assert poll_result(client, "gone") == 0
        assert client.stats()["timeouts"] == 1


def test_a_second_responder_on_an_endpoint_keeps_its_registration() -> None:
    class Stub:
        pass

    first, second = Stub(), Stub()
    local.register("ipc:///nowhere", first)
    local.register("ipc:///nowhere", second)
    local.unregister("ipc:///nowhere", first)  # the one that went: not the one serving
    assert local.find("ipc:///nowhere") is second
    local.unregister("ipc:///nowhere", second)
    assert local.find("ipc:///nowhere") is None


def test_a_forked_child_finds_none_of_its_parents_responders(endpoints, responder) -> None:
    import os

    assert local.find(endpoints.requests[0]) is responder
    pid = os.fork()
    if pid == 0:  # the child: the parent's responder has no threads here
        os._exit(0 if local.find(endpoints.requests[0]) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
