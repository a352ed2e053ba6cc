"""A worker's lookup responder under requests that would make it allocate or stall:
one responder in this process, a real engine, raw ZMQ peers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from lmkv.engines.local import LocalEngine
from lmkv.keys.chunking import prefix_hashes
from lmkv.lookup import (
    LookupCleanup,
    LookupEndpoints,
    LookupRequest,
    LookupResponder,
    LookupResponse,
)
from lmkv.lookup.messages import decode, encode, max_request_bytes
from tests.lookup.conftest import CHUNK, prompt, wait_for
from tests.lookup.worker_proc import hf_kv

MAX_CHUNKS = 1024
BIG = 600  # chunks: over the responder's BULK_CHUNKS, so it takes the bulk lane


class Peer:
    """The scheduler's end, by hand: a PUSH to the worker, a bound PULL for answers."""

    def __init__(self, endpoints: LookupEndpoints) -> None:
        self.context = zmq.Context()
        self.answers = self.context.socket(zmq.PULL)
        self.answers.setsockopt(zmq.LINGER, 0)
        self.answers.bind(endpoints.responses)
        self.requests = self.context.socket(zmq.PUSH)
        self.requests.setsockopt(zmq.LINGER, 0)
        self.requests.connect(endpoints.requests[0])

    def ask(self, lookup_id: str, hashes: list[bytes]) -> None:
        self.requests.send(encode(LookupRequest(lookup_id, hashes, chunk_ends(len(hashes)))))

    def receive(self, n: int, timeout_s: float = 15.0) -> dict[str, int]:
        """The next ``n`` answers, by lookup id (fails after ``timeout_s``)."""
        got: dict[str, int] = {}
        for _ in range(n):
            if not self.answers.poll(int(timeout_s * 1000)):
                raise AssertionError(f"no answer after {len(got)} of {n}: {got}")
            answer = decode(self.answers.recv())
            assert isinstance(answer, LookupResponse) and answer.rank == 0
            got[answer.lookup_id] = answer.num_hit_tokens
        return got

    def close(self) -> None:
        self.answers.close()
        self.requests.close()
        self.context.term()


def chunk_ends(n: int) -> list[int]:
    return [(i + 1) * CHUNK for i in range(n)]


def misses(n: int, seed: int = 7) -> list[bytes]:
    return prefix_hashes(prompt(seed, n), CHUNK)


@pytest.fixture
def peer(endpoints: LookupEndpoints) -> Iterator[Peer]:
    peer = Peer(endpoints)
    yield peer
    peer.close()


def held_refs(engine: LocalEngine) -> int:
    tier = engine.storage.tiers[0]
    return sum(refs - 1 for refs, _ in tier.entry_refs())


def test_a_burst_of_large_lookups_gives_its_memory_back_while_idle(engine, endpoints,
                                                                  peer) -> None:
    engine.storage.events.unclaimed_ttl_s = 0.2  # (the timer takes it within a second)
    tokens = prompt(1, 8)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    hashes = prefix_hashes(tokens, CHUNK) + misses(BIG, seed=2)[8:]  # 8 hits, then misses
    with LookupResponder(engine, endpoints.requests[0], endpoints.responses, rank=0,
                      max_chunks=MAX_CHUNKS) as responder:
        for i in range(20):  # nobody retrieves or cleans up: a crashed scheduler, a peer
            peer.ask(f"burst-{i}", hashes)
        answers = peer.receive(20)
        stats = responder.stats()
        # Shed requests answer 0; every other one found the 8 stored chunks.
        assert sorted(set(answers.values())) in ([8 * CHUNK], [0, 8 * CHUNK])
        assert list(answers.values()).count(0) == stats["shed"]
        assert stats["queued_chunks"] == stats["inflight_chunks"] == 0
        assert len(engine.storage.events) == 20 - stats["shed"]  # held for a retrieve
        assert held_refs(engine) > 0
        # No further lookup arrives: the timer alone releases what they hold.
        wait_for(lambda: len(engine.storage.events) == 0, "the unclaimed prefetches to expire")
        assert held_refs(engine) == 0


def test_an_oversize_request_is_answered_zero_without_being_read(engine, endpoints,
                                                                  peer) -> None:
    tokens = prompt(3, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    stored = prefix_hashes(tokens, CHUNK)
    max_chunks = 64
    with LookupResponder(engine, endpoints.requests[0], endpoints.responses, rank=0,
                      max_chunks=max_chunks) as responder:
        hits = engine.storage.tiers[0].counters.hits
        # Too many chunks in a message that could hold max_chunks: decoded, then refused.
        peer.ask("too-many", stored + misses(max_chunks + 1)[2:])
        # A message too long for any valid request: only its id is read.
        huge = stored + misses(5000)[2:]
        message = encode(LookupRequest("too-long", huge, chunk_ends(len(huge))))
        assert max_request_bytes(max_chunks) < len(message) < 4 * max_request_bytes(max_chunks)
        peer.requests.send(message)
        assert peer.receive(2) == {"too-many": 0, "too-long": 0}
        assert responder.stats()["oversize"] == 2
        assert len(engine.storage.events) == 0  # the engine never saw them
        assert engine.storage.tiers[0].counters.hits == hits
        # A message over the socket's limit never arrives; the worker serves on.
        bigger = misses(20_000)
        peer.requests.send(encode(LookupRequest("dropped", bigger, chunk_ends(len(bigger)))))
        peer.ask("within", stored)
        assert peer.receive(1) == {"within": 2 * CHUNK}
        engine.release_lookup("within")


def test_a_request_of_the_model_length_is_served(engine, endpoints, peer) -> None:
    config = engine.config.model_copy(update={"lookup": engine.config.lookup.model_copy(
        update={"max_tokens": 100 * CHUNK})})
    tokens = prompt(4, 100)
    engine.store(tokens, kv=hf_kv(len(tokens)))

    class Configured:  # the engine, with a config whose lookup.max_tokens is 100 chunks
        def __init__(self) -> None:
            self.config = config

        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

    with LookupResponder.for_rank(Configured(), endpoints, 0) as responder:
        assert responder.max_chunks == 100
        peer.ask("at-limit", prefix_hashes(tokens, CHUNK))
        peer.ask("over", prefix_hashes(tokens + [1] * CHUNK, CHUNK))
        assert peer.receive(2) == {"at-limit": 100 * CHUNK, "over": 0}
        engine.release_lookup("at-limit")


class GatedEngine:
    """The real engine; starting the big lookup blocks until the test opens the gate
    (a long prompt whose keys take a while to build, on a loaded machine)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.gate = threading.Event()
        self.entered = threading.Event()

    def lookup_and_prefetch_hashes(self, lookup_id: str, hashes: list[bytes],
                                   ends: list[int]) -> Future:
        if len(hashes) >= BIG:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.engine.lookup_and_prefetch_hashes(lookup_id, hashes, ends)

    def release_lookup(self, lookup_id: str) -> None:
        self.engine.release_lookup(lookup_id)


def test_small_lookups_are_answered_while_a_big_one_is_in_progress(engine, endpoints,
                                                                   peer) -> None:
    tokens = prompt(5, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    stored = prefix_hashes(tokens, CHUNK)
    gated = GatedEngine(engine)
    with LookupResponder(gated, endpoints.requests[0], endpoints.responses, rank=0,
                      max_chunks=MAX_CHUNKS) as responder:
        try:
            peer.ask("big", stored + misses(BIG)[2:])
            assert gated.entered.wait(15), "the big lookup never started"
            for i in range(5):
                peer.ask(f"small-{i}", stored)
            assert peer.receive(5) == {f"small-{i}": 2 * CHUNK for i in range(5)}
        finally:
            gated.gate.set()
        assert peer.receive(1) == {"big": 2 * CHUNK}
        # (the count follows the send: the peer may read the answer first)
        wait_for(lambda: responder.stats()["answers"] == 6, "every answer to be counted")
    for lookup_id in ("big", *(f"small-{i}" for i in range(5))):
        engine.release_lookup(lookup_id)
    assert held_refs(engine) == 0


def test_a_cleanup_reaching_a_queued_bulk_request_drops_it(engine, endpoints, peer) -> None:
    tokens = prompt(6, 2)
    engine.store(tokens, kv=hf_kv(len(tokens)))
    stored = prefix_hashes(tokens, CHUNK)
    gated = GatedEngine(engine)
    with LookupResponder(gated, endpoints.requests[0], endpoints.responses, rank=0,
                      max_chunks=MAX_CHUNKS) as responder:
        try:
            peer.ask("first", stored + misses(BIG)[2:])  # holds the bulk lane
            assert gated.entered.wait(15)
            peer.ask("queued", stored + misses(BIG, seed=8)[2:])
            wait_for(lambda: responder.stats()["queued_requests"] == 1, "the queued request")
            peer.requests.send(encode(LookupCleanup("queued")))
            wait_for(lambda: responder.stats()["cleanups"] == 1, "the cleanup")
        finally:
            gated.gate.set()
        answers = peer.receive(2)
        assert answers == {"first": 2 * CHUNK, "queued": 0}  # answered once, never started
        assert responder.stats()["dropped_queued"] == 1
    assert len(engine.storage.events) == 1  # "first" only
    engine.release_lookup("first")
    assert held_refs(engine) == 0
