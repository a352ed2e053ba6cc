"""``RemoteEngine`` (server mode) against a real ``lmkv server`` on loopback."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from lmkv.config.model import load_config
from lmkv.contracts.connector import ConnectorContext, KVSpec
from lmkv.engines import open_engine
from lmkv.engines.remote import RemoteEngine
from lmkv.keys.chunking import prefix_hashes
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.connectors.paged import PagedConnector
from tests.server.procs import free_port, start_server, wait_for

pytestmark = pytest.mark.slow  # a real lmkv server

L, H, D, BLOCK, CHUNK = 2, 2, 32, 8, 16
SPEC = KVSpec(L, H, D, torch.bfloat16)  # a 16-token chunk is 8 KiB


def config(server, data_path: str = "auto", **extra):
    return load_config(overrides={"lmkv.mode": "server", "lmkv.chunk_size": CHUNK,
                                  "lmkv.server.address": server.address,
                                  "lmkv.server.timeout_ms": 5000,
                                  "lmkv.server.data_path": data_path, **extra})


def paged_engine(cfg) -> RemoteEngine:
    engine = open_engine(cfg, SPEC, model_name="remote-test",
                         connector=PagedConnector(None, ConnectorContext(SPEC)))
    assert isinstance(engine, RemoteEngine)
    return engine


def caches(seed: int | None, blocks: int = 16) -> list[torch.Tensor]:
    shape = (blocks, H, BLOCK, 2 * D)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(L)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(L)]


def tokens_kv(kv: list[torch.Tensor], block_ids: list[int], n: int) -> list[torch.Tensor]:
    """Per layer, the KV of the first ``n`` tokens in token order."""
    out = []
    for cache in kv:
        rows = torch.cat([cache[b] for b in block_ids], dim=1)  # [H, blocks * BLOCK, 2D]
        out.append(rows[:, :n])
    return out


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n)]


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_kv_stored_by_one_engine_loads_into_another_bit_identical(server, data_path) -> None:
    tokens = prompt(1 if data_path == "auto" else 2, 5 * CHUNK + 3)  # 5 whole chunks
    src, src_blocks = caches(7), [3, 9, 1, 4, 12, 6, 0, 2, 5, 7, 8]
    with paged_engine(config(server, data_path)) as writer:
        assert writer.client.shared_memory == (data_path == "auto")
        assert writer.store(tokens, kv_caches=src, block_ids=src_blocks) == 5 * CHUNK
        assert writer.store(tokens, kv_caches=src, block_ids=src_blocks) == 0  # held already
        assert writer.lookup(tokens) == 5 * CHUNK
    dst, dst_blocks = caches(None), [15, 14, 13, 0, 1, 2, 3, 4, 5, 6, 7]
    with paged_engine(config(server, data_path)) as reader:  # another session
        got = reader.retrieve(tokens, kv_caches=dst, block_ids=dst_blocks)
        assert got.num_tokens == 5 * CHUNK
        assert reader.client.counters.error_replies == 0
    n = 5 * CHUNK
    for a, b in zip(tokens_kv(src, src_blocks, n), tokens_kv(dst, dst_blocks, n), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    untouched = set(range(16)) - set(dst_blocks[:n // BLOCK])
    assert all(not dst[layer][b].any() for layer in range(L) for b in untouched)


def test_prefetched_lookup_is_what_retrieve_loads(server) -> None:
    tokens = prompt(3, 4 * CHUNK)
    src, blocks = caches(11), list(range(8))
    with paged_engine(config(server)) as engine:
        engine.store(tokens[:2 * CHUNK], kv_caches=src, block_ids=blocks)
        hashes = prefix_hashes(tokens, CHUNK)
        ends = [CHUNK * (i + 1) for i in range(4)]
        assert engine.lookup_and_prefetch_hashes("req-1", hashes, ends).result(5) == 2 * CHUNK
        stats = engine.client.stats().server  # lent with the answer (tests/engines/
        assert (stats.held_lookups, stats.leased_chunks) == (0, 2)  # test_remote_lent.py)
        dst = caches(None)
        got = engine.retrieve(tokens, lookup_id="req-1", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == 2 * CHUNK
        stats = engine.client.stats().server
        assert (stats.held_lookups, stats.leased_chunks) == (0, 0)  # consumed
        assert all(torch.equal(a, b) for a, b in zip(tokens_kv(src, blocks, 2 * CHUNK),
                                                     tokens_kv(dst, blocks, 2 * CHUNK),
                                                     strict=True))
        # A lookup that will not be loaded is released, server-side too.
        assert engine.lookup_and_prefetch_hashes("req-2", hashes, ends).result(5) == 2 * CHUNK
        engine.release_lookup("req-2")
        assert wait_for(lambda: engine.client.stats().server.leased_chunks == 0)  # one way
        assert engine.client.stats().server.held_lookups == 0
        assert engine.lookup_and_prefetch_hashes("req-3", [], []).result(1) == 0


def test_lookup_and_prefetch_by_tokens_as_in_process(server) -> None:
    tokens = prompt(4, 3 * CHUNK + 5)
    src, blocks = caches(13), list(range(8))
    with paged_engine(config(server)) as engine:
        engine.store(tokens[:2 * CHUNK], kv_caches=src, block_ids=blocks)
        assert engine.lookup_and_prefetch(tokens, "by-tokens").result(5) == 2 * CHUNK
        assert engine.client.stats().server.leased_chunks == 2  # lent with the answer
        dst = caches(None)
        got = engine.retrieve(tokens, lookup_id="by-tokens", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == 2 * CHUNK
        stats = engine.client.stats().server
        assert (stats.held_lookups, stats.leased_chunks) == (0, 0)  # the prefetch was taken
        assert all(torch.equal(a, b) for a, b in zip(tokens_kv(src, blocks, 2 * CHUNK),
                                                     tokens_kv(dst, blocks, 2 * CHUNK),
                                                     strict=True))
        assert engine.lookup_and_prefetch(prompt(5, 2 * CHUNK), "miss").result(5) == 0
        assert engine.lookup_and_prefetch([], "empty").result(1) == 0


def test_prefetch_from_disk_after_a_server_restart(tmp_path) -> None:
    """A restarted server finds the chunks on its disk tier only: the prefetch
    reads them back (asynchronously) and the load is bit-identical."""
    disk = tmp_path / "disk"
    tiers = (f"tiers:\n  - type: cpu\n    options: {{max_bytes: 16MiB}}\n"
             f"  - type: fs\n    options: {{url: '{disk}'}}\n")
    tokens = prompt(4, 3 * CHUNK)
    src, blocks = caches(5), list(range(6))
    port = free_port()
    first = start_server(tmp_path, tiers, port=port, name="first")
    try:
        with paged_engine(config(first)) as engine:
            assert engine.store(tokens, kv_caches=src, block_ids=blocks) == 3 * CHUNK
    finally:
        assert first.stop(signal.SIGTERM) == 0, first.log()  # drains the disk writes
    second = start_server(tmp_path, tiers, port=port, name="second")
    try:
        with paged_engine(config(second)) as engine:
            hashes = prefix_hashes(tokens, CHUNK)
            future = engine.lookup_and_prefetch_hashes("disk", hashes, [16, 32, 48])
            assert future.result(10) == 3 * CHUNK
            dst = caches(None)
            assert engine.retrieve(tokens, lookup_id="disk", kv_caches=dst,
                                   block_ids=blocks).num_tokens == 3 * CHUNK
    finally:
        second.stop(signal.SIGTERM)
    assert all(torch.equal(a, b) for a, b in zip(tokens_kv(src, blocks, 3 * CHUNK),
                                                 tokens_kv(dst, blocks, 3 * CHUNK),
                                                 strict=True))


def test_transformers_style_engine_in_server_mode(server) -> None:
    """``open_engine`` honours ``mode: server`` with the connector it resolves (the hf
    connector builds its KV from the server's chunks before they are released)."""
    tokens = prompt(5, 2 * CHUNK)
    gen = torch.Generator().manual_seed(3)
    kv = [(torch.randn(1, H, 2 * CHUNK, D, generator=gen).to(torch.bfloat16),
           torch.randn(1, H, 2 * CHUNK, D, generator=gen).to(torch.bfloat16))
          for _ in range(L)]
    with open_engine(config(server), SPEC, model_name="remote-hf") as engine:
        assert isinstance(engine, RemoteEngine) and isinstance(engine.connector, HFConnector)
        assert engine.store(tokens, kv=kv) == 2 * CHUNK
        got = engine.retrieve(tokens)
    assert got.num_tokens == 2 * CHUNK
    for (k, v), (k2, v2) in zip(kv, got.kv, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_no_server_is_a_miss_not_an_error() -> None:
    cfg = load_config(overrides={"lmkv.mode": "server", "lmkv.chunk_size": CHUNK,
                                 "lmkv.server.address": f"tcp://127.0.0.1:{free_port()}",
                                 "lmkv.server.timeout_ms": 200})
    tokens = prompt(6, 2 * CHUNK)
    t0 = time.monotonic()
    with paged_engine(cfg) as engine:
        kv, blocks = caches(1), list(range(4))
        assert engine.store(tokens, kv_caches=kv, block_ids=blocks) == 0
        assert engine.lookup(tokens) == 0
        future = engine.lookup_and_prefetch_hashes("x", prefix_hashes(tokens, CHUNK), [16, 32])
        assert future.result(5) == 0
        assert engine.retrieve(tokens, kv_caches=kv, block_ids=blocks).num_tokens == 0
        assert engine.client.counters.unreachable + engine.client.counters.timeouts > 0
    assert time.monotonic() - t0 < 5


def test_spawn_server_starts_a_server_that_drains_on_terminate(tmp_path) -> None:
    from lmkv.rpc.client import ServerClient
    from lmkv.testing.server import spawn_server

    tiers = "tiers:\n  - type: cpu\n    options: {max_bytes: 8MiB}\n"
    proc, address = spawn_server(tmp_path, tiers)
    try:
        with ServerClient(address, timeout_ms=2000) as client:
            assert client.ping() is not None
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert list(tmp_path.glob("server-*.log"))


def test_a_closed_engine_opens_no_connection_again(server) -> None:
    """A metrics scrape (or any late caller) of a closed engine is a miss that connects
    nowhere: a socket it reopened would go on reconnecting after its owner is gone."""
    engine = open_engine(config(server), SPEC, model_name="remote-closed")
    assert isinstance(engine, RemoteEngine)
    with engine:
        assert engine.stats()  # connected
    assert engine.stats() == []
    assert engine.lookup(prompt(6, CHUNK)) == 0
    assert engine.client._channel._socket is None
    assert engine._lookups._channel._socket is None
