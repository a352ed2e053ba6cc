"""Chunks a server-mode lookup's reply lends (``lookup`` with ``lend``): the load
that follows asks the server nothing, and loads exactly what a ``retrieve`` of
the lookup would have, or asks when it may not use them."""

from __future__ import annotations

import signal

import pytest
import torch

from lmkv.keys.chunking import prefix_hashes
from tests.engines.test_block_hits import BLOCK, fresh, hf_kv
from tests.engines.test_block_hits import CHUNK as CHUNK_B
from tests.engines.test_block_hits import same_kv as same_kv_b
from tests.engines.test_remote import CHUNK, caches, config, paged_engine, prompt, tokens_kv
from tests.engines.test_remote_block_hits import remote
from tests.server.procs import start_server, wait_for

pytestmark = pytest.mark.slow  # a real lmkv server


def held(engine) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(prefetches held, chunks leased) for sessions on the engine's server."""
    stats = engine.client.stats().server
    return stats.held_lookups, stats.leased_chunks


def released(engine) -> bool:  # type: ignore[no-untyped-def]
    # (a release goes one way, maybe on the lookup connection: it lands soon)
    return bool(wait_for(lambda: held(engine) == (0, 0), timeout_s=10))


def same_kv(a: list[torch.Tensor], b: list[torch.Tensor], blocks: list[int], n: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tokens_kv(a, blocks, n), tokens_kv(b, blocks, n),
                                                 strict=True))


def test_the_lookup_lends_and_the_load_asks_nothing(server) -> None:
    tokens = prompt(21, 4 * CHUNK)
    src, blocks = caches(21), list(range(8))
    with paged_engine(config(server)) as engine:
        assert engine.store(tokens[:3 * CHUNK], kv_caches=src, block_ids=blocks) == 3 * CHUNK
        hashes, ends = prefix_hashes(tokens, CHUNK), [CHUNK * (i + 1) for i in range(4)]
        assert engine.lookup_and_prefetch_hashes("r", hashes, ends).result(5) == 3 * CHUNK
        assert held(engine) == (0, 3)  # lent: a lease, not a held prefetch
        asked = requests(engine)
        dst = caches(None)
        got = engine.retrieve(tokens, lookup_id="r", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == 3 * CHUNK
        assert same_kv(src, dst, blocks, 3 * CHUNK)
        assert requests(engine) == asked  # the load sent nothing
        assert released(engine)
        assert engine.client.counters.error_replies == 0


def requests(engine) -> int:  # type: ignore[no-untyped-def]
    """Requests the engine's clients sent (its heartbeats' aside)."""
    return engine.client.counters.requests + engine._lookups.counters.requests


def test_lent_chunks_of_another_prompt_are_never_loaded(server) -> None:
    """A lookup id used again for another prompt: the load gets that prompt's own
    KV (asked from the server), never what the first lookup lent."""
    first, other = prompt(22, 2 * CHUNK), prompt(23, 2 * CHUNK)
    src_a, src_b, blocks = caches(22), caches(23), list(range(4))
    with paged_engine(config(server)) as engine:
        engine.store(first, kv_caches=src_a, block_ids=blocks)
        engine.store(other, kv_caches=src_b, block_ids=blocks)
        ends = [CHUNK, 2 * CHUNK]
        assert engine.lookup_and_prefetch_hashes("same", prefix_hashes(first, CHUNK),
                                                 ends).result(5) == 2 * CHUNK
        dst = caches(None)
        got = engine.retrieve(other, lookup_id="same", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == 2 * CHUNK
        assert same_kv(src_b, dst, blocks, 2 * CHUNK)
        assert released(engine)
        # A longer prompt than the lookup's: only the lent chunks' tokens come lent,
        # and the load never goes past the prefix they lead.
        longer = first + prompt(24, CHUNK)
        assert engine.lookup_and_prefetch_hashes("long", prefix_hashes(first[:CHUNK], CHUNK),
                                                 [CHUNK]).result(5) == CHUNK
        dst = caches(None)
        got = engine.retrieve(longer, lookup_id="long", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == CHUNK
        assert same_kv(src_a, dst, blocks, CHUNK)
        assert not any(d[b].any() for d in dst for b in blocks[CHUNK // 8:])
        assert released(engine)


def test_released_lookups_give_lent_chunks_back(server) -> None:
    tokens = prompt(25, 2 * CHUNK)
    with paged_engine(config(server)) as engine:
        engine.store(tokens, kv_caches=caches(25), block_ids=list(range(4)))
        hashes, ends = prefix_hashes(tokens, CHUNK), [CHUNK, 2 * CHUNK]
        assert engine.lookup_and_prefetch_hashes("drop", hashes, ends).result(5) == 2 * CHUNK
        assert held(engine) == (0, 2)
        engine.release_lookup("drop")
        assert released(engine)
        # The same id looked up twice: the first lease is given back.
        for _ in range(2):
            engine.lookup_and_prefetch_hashes("twice", hashes, ends).result(5)
        assert wait_for(lambda: held(engine) == (0, 2), timeout_s=10)
        engine.lookup_and_prefetch_hashes("at-close", hashes, ends).result(5)
        engine.release_lookup("twice")
        with paged_engine(config(server)) as other:
            engine.close()  # gives back what it was lent
            assert released(other)


def test_lent_chunks_too_old_to_read_are_given_back_and_asked_for(server, monkeypatch) -> None:
    tokens = prompt(26, 2 * CHUNK)
    src, blocks = caches(26), list(range(4))
    with paged_engine(config(server)) as engine:
        engine.store(tokens, kv_caches=src, block_ids=blocks)
        hashes, ends = prefix_hashes(tokens, CHUNK), [CHUNK, 2 * CHUNK]
        assert engine.lookup_and_prefetch_hashes("old", hashes, ends).result(5) == 2 * CHUNK
        monkeypatch.setattr(type(engine._lookups), "_lent_max_age_s", lambda self: -1.0)
        asked = requests(engine)
        dst = caches(None)
        assert engine.retrieve(tokens, lookup_id="old", kv_caches=dst,
                               block_ids=blocks).num_tokens == 2 * CHUNK
        assert same_kv(src, dst, blocks, 2 * CHUNK)
        assert requests(engine) - asked == 1  # a retrieve
        assert released(engine)


def test_lent_chunks_nobody_takes_are_given_back_by_the_heartbeat(server) -> None:
    """An engine that lookups and then goes idle holds its lent chunks only for
    their age: its heartbeat gives them back, with no request of the engine's."""
    tokens = prompt(28, 2 * CHUNK)
    with paged_engine(config(server)) as engine, server.client() as watcher:
        engine.store(tokens, kv_caches=caches(28), block_ids=list(range(4)))
        engine._lookups._lent_max_age_s = lambda: 0.3  # type: ignore[method-assign]
        hashes, ends = prefix_hashes(tokens, CHUNK), [CHUNK, 2 * CHUNK]
        assert engine.lookup_and_prefetch_hashes("idle", hashes, ends).result(5) == 2 * CHUNK
        asked = requests(engine)
        assert watcher.stats().server.leased_chunks == 2
        assert wait_for(lambda: watcher.stats().server.leased_chunks == 0, timeout_s=10)
        assert requests(engine) == asked  # none of the engine's requests
        assert engine._lookups.take_lent("idle") is None


@pytest.mark.parametrize("why", ["inline", "limits"])
def test_no_lend_leaves_the_prefetch_for_a_retrieve(tmp_path, why) -> None:
    """A client on the inline data path is never lent chunks; one whose session
    holds half the handles its limits allow keeps the prefetch held (the rest
    stays for stores and retrieves): both load it with a retrieve, as before
    lookups could lend."""
    limits = "server: {session_max_handles: 4}\n" if why == "limits" else ""
    srv = start_server(tmp_path, "tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n"
                       + limits)
    try:
        tokens = prompt(27, 2 * CHUNK)
        src, blocks = caches(27), list(range(4))
        data_path = "inline" if why == "inline" else "auto"
        with paged_engine(config(srv, data_path)) as engine:
            engine.store(tokens, kv_caches=src, block_ids=blocks)
            hashes, ends = prefix_hashes(tokens, CHUNK), [CHUNK, 2 * CHUNK]
            if why == "limits":  # two of the four handles lent: half the limit
                for first in ("first", "second"):
                    assert engine.lookup_and_prefetch_hashes(first, hashes, ends).result(5)
                assert held(engine) == (0, 4)
            assert engine.lookup_and_prefetch_hashes("r", hashes, ends).result(5) == 2 * CHUNK
            assert held(engine)[0] == 1
            if why == "limits":
                for first in ("first", "second"):
                    engine.release_lookup(first)
                assert wait_for(lambda: held(engine) == (1, 0), timeout_s=10)
            dst = caches(None)
            got = engine.retrieve(tokens, lookup_id="r", kv_caches=dst, block_ids=blocks)
            assert got.num_tokens == 2 * CHUNK
            assert same_kv(src, dst, blocks, 2 * CHUNK)
            assert released(engine)
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.log()


def test_a_partial_hit_comes_lent_for_the_prompt_cut_there(server) -> None:
    """A hit ending inside a chunk (block-granular hits) is lent under the key of
    its leading blocks: the load of the prompt cut at the hit asks nothing, and
    gets those blocks' KV only."""
    a = fresh(108, 31)
    with remote(server.address) as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:44] + fresh(30, 44)
        hit = 44 // BLOCK * BLOCK
        assert hit % CHUNK_B  # inside a chunk
        assert engine.lookup_and_prefetch(b, "cut").result(10) == hit
        asked = requests(engine)
        result = engine.retrieve(b[:hit], lookup_id="cut")
        assert result.num_tokens == hit and same_kv_b(result, b, hit)
        assert requests(engine) == asked  # the load sent nothing
        assert released(engine)


def test_nothing_is_lent_to_a_process_the_server_cannot_verify(server) -> None:
    """A lookup asking to ``lend`` without naming a process that maps the arena (a
    client on another host, say) keeps its prefetch held: a lease it could not
    read would only hold buffers."""
    from lmkv.rpc import protocol as p

    tokens = prompt(29, 2 * CHUNK)
    with paged_engine(config(server)) as engine:
        engine.store(tokens, kv_caches=caches(29), block_ids=list(range(4)))
        for claim in ("", "otherhost|4026531836|1|1"):
            got = engine.client._call(p.Lookup(
                meta=engine.meta, chunk_hashes=prefix_hashes(tokens, CHUNK),
                chunk_ends=[CHUNK, 2 * CHUNK], lookup_id=f"unverified{len(claim)}",
                wait=False, lend=True, process=claim), p.LookupReply)
            assert got is not None
            assert (got[0].hit_tokens, got[0].handle, got[0].chunks) == (2 * CHUNK, 0, [])
        assert held(engine) == (2, 0)
