"""Block-granular hits through a real ``lmkv server`` (``mode: server``): the
scenarios of test_block_hits.py, on both data paths, across client processes
and from the server's disk tier; old-style requests are still served."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import torch

from lmkv import load_config
from lmkv.engines import open_engine
from lmkv.engines.remote import RemoteEngine
from lmkv.keys.chunking import Identity, block_prefix_hashes, prefix_hashes
from lmkv.rpc import protocol as p
from lmkv.testing.server import spawn_server
from tests.engines.test_block_hits import BLOCK, CHUNK, SPEC, fresh, hf_kv, same_kv
from tests.server.procs import REPO, child_env

pytestmark = pytest.mark.slow  # a real lmkv server


def remote(address: str, data_path: str = "auto", model: str = "block-remote",
           **overrides) -> RemoteEngine:
    config = load_config(env={}, overrides={
        "lmkv.mode": "server", "lmkv.chunk_size": CHUNK, "lmkv.block_size": BLOCK,
        "lmkv.server.address": address, "lmkv.server.timeout_ms": 5000,
        "lmkv.server.data_path": data_path, **overrides})
    engine = open_engine(config, SPEC, model_name=model)
    assert isinstance(engine, RemoteEngine)
    return engine


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_a_prompt_leaving_a_stored_one_inside_a_chunk_hits_its_whole_blocks(
        server, data_path) -> None:
    a = fresh(108, 11 if data_path == "auto" else 12)
    with remote(server.address, data_path) as engine:
        assert engine.client.shared_memory == (data_path == "auto")
        assert engine.store(a, kv=hf_kv(a)) == 104  # 3 chunks and the 1-block tail
        assert engine.lookup(a) == 104
        result = engine.retrieve(a)
        assert result.num_tokens == 104 and same_kv(result, a, 104)
        for split in (33, 40, 47, 50, 63, 70, 95, 100):
            b = a[:split] + fresh(30, split)
            hit = split // BLOCK * BLOCK
            assert engine.lookup(b) == hit, split
            result = engine.retrieve(b)
            assert result.num_tokens == hit and same_kv(result, b, hit), split
            assert engine.lookup_and_prefetch(b, f"l{split}").result(10) == hit
            result = engine.retrieve(b[:hit], lookup_id=f"l{split}")
            assert result.num_tokens == hit and same_kv(result, b, hit), split
            # The whole prompt with the id: its keys are not the prefetch's (that ended
            # inside a chunk), so the server fetches them now: the same hit.
            assert engine.lookup_and_prefetch(b, f"w{split}").result(10) == hit
            result = engine.retrieve(b, lookup_id=f"w{split}")
            assert result.num_tokens == hit and same_kv(result, b, hit), split
        assert engine.client.counters.error_replies == 0
        assert engine.counters.spec_mismatches == 0
        assert engine.client.stats().server.held_lookups == 0


def test_another_identity_or_prefix_never_hits_the_blocks(server) -> None:
    a = fresh(64, 13)
    with remote(server.address) as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:48] + fresh(16, 14)
        assert engine.lookup(b) == 48
        assert engine.lookup(b, identity=Identity(salt="tenant")) == 0
        assert engine.retrieve(b, identity=Identity(salt="tenant")).num_tokens == 0
        c = [a[0] + 1, *a[1:48], *fresh(16, 15)]  # differs in chunk 0
        assert engine.lookup(c) == 0
        d = [*a[:32], a[32] + 1, *a[33:48]]  # differs in the chunk's first block
        assert engine.lookup(d) == 32
        assert engine.retrieve(d).num_tokens == 32


def test_a_lookup_id_reused_for_another_prompt_never_yields_its_kv(server) -> None:
    a, other = fresh(64, 16), fresh(64, 17)
    with remote(server.address) as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:48] + fresh(16, 18)
        assert engine.lookup_and_prefetch(b, "reused").result(10) == 48
        assert engine.retrieve(other, lookup_id="reused").num_tokens == 0  # not b's KV
        engine.store(other, kv=hf_kv(other))
        assert engine.lookup_and_prefetch(b, "reused").result(10) == 48
        c = other[:40] + fresh(8, 19)  # another stored prompt, another partial hit
        result = engine.retrieve(c, lookup_id="reused")
        assert result.num_tokens == 40 and same_kv(result, c, 40)
        assert engine.client.stats().server.held_lookups == 0


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_a_retrieve_by_lookup_id_alone_gets_whole_chunks_only(server, data_path) -> None:
    """A raw retrieve that names no keys cannot have a partial hit's chunk cut to its
    tokens: it gets the whole chunks before it, never a chunk of another prompt's
    tokens shaped like its own."""
    a = fresh(64, 21)
    with remote(server.address, data_path) as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:40] + fresh(24, 22)
        chunks = engine.chunker.chunk(b)  # (the client's own lookup: nothing lent)
        assert engine.client.lookup(chunks.keys, chunks.ends, lookup_id="keyless",
                                    partial_hashes=engine._partial_hashes(chunks),
                                    block_tokens=engine.block_size or 0) == 40
        views = engine.client.retrieve(lookup_id="keyless")
        assert [v.shape[2] for v in views] == [32]
        assert engine.client.stats().server.held_lookups == 0


def test_prefetch_by_hashes_computed_elsewhere(server) -> None:
    """The lookup channel hashes in the scheduler: ``lookup_and_prefetch_hashes`` with
    partial hashes hits the blocks; without them it hits whole chunks only."""
    a = fresh(96, 20)
    with remote(server.address) as engine:
        engine.store(a, kv=hf_kv(a))
        b = a[:70] + fresh(10, 21)
        n = len(b) // BLOCK * BLOCK
        hashes = prefix_hashes(b[:n], CHUNK, keep_partial=True)
        ends = [min(CHUNK * (i + 1), n) for i in range(len(hashes))]
        partials = block_prefix_hashes(b[:n], CHUNK, BLOCK, full=hashes)
        assert engine.lookup_and_prefetch_hashes("h", hashes, ends, partials,
                                                 BLOCK).result(10) == 64
        result = engine.retrieve(b[:64], lookup_id="h")
        assert result.num_tokens == 64 and same_kv(result, b, 64)
        assert engine.lookup_and_prefetch_hashes("whole", hashes, ends).result(10) == 64
        engine.release_lookup("whole")
        c = a[:50] + fresh(10, 22)
        hashes = prefix_hashes(c[:56], CHUNK, keep_partial=True)
        partials = block_prefix_hashes(c[:56], CHUNK, BLOCK, full=hashes)
        assert engine.lookup_and_prefetch_hashes("c", hashes, [32, 56], partials,
                                                 BLOCK).result(10) == 48
        assert engine.lookup_and_prefetch_hashes("c0", hashes, [32, 56]).result(10) == 32
        # Blocks of another size than the engine's are not used (as in process).
        assert engine.lookup_and_prefetch_hashes("c4", hashes, [32, 56], partials,
                                                 BLOCK // 2).result(10) == 32
        for lookup_id in ("c", "c0", "c4"):
            engine.release_lookup(lookup_id)
        assert engine.client.stats().server.held_lookups == 0


CHILD = """
import json, sys
from tests.engines.test_remote_block_hits import remote
from tests.engines.test_block_hits import BLOCK, fresh, hf_kv, same_kv
address, data_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
a = fresh(108, seed)
out = {}
with remote(address, data_path) as engine:
    for split in (40, 50, 100):
        b = a[:split] + fresh(30, split)
        hit = split // BLOCK * BLOCK
        got = engine.retrieve(b)
        prefetched = engine.lookup_and_prefetch(b, "x").result(10)
        again = engine.retrieve(b[:hit], lookup_id="x")
        out[split] = [engine.lookup(b), got.num_tokens, same_kv(got, b, hit), prefetched,
                      again.num_tokens, same_kv(again, b, hit)]
    out["errors"] = engine.client.counters.error_replies
print(json.dumps(out))
"""


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_a_fresh_client_process_finds_the_blocks_another_stored(server, data_path) -> None:
    seed = 23 if data_path == "auto" else 24
    a = fresh(108, seed)
    with remote(server.address, data_path) as engine:
        assert engine.store(a, kv=hf_kv(a)) == 104
    done = subprocess.run([sys.executable, "-c", CHILD, server.address, data_path, str(seed)],
                          capture_output=True, text=True, timeout=120, env=child_env(),
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out.pop("errors") == 0
    for split, got in out.items():
        hit = int(split) // BLOCK * BLOCK
        assert got == [hit, hit, True, hit, hit, True], split


def test_blocks_hit_from_the_disk_tier_of_a_restarted_server(tmp_path) -> None:
    """Aliases go down the tiers like chunks: a new server that has them on disk only
    serves a chunk's leading blocks (read through the alias to its chunk)."""
    tiers = (f"tiers:\n  - type: cpu\n    options: {{max_bytes: 16MiB}}\n"
             f"  - type: fs\n    options: {{url: '{tmp_path / 'disk'}'}}\n")
    a = fresh(108, 25)
    b = a[:50] + fresh(20, 26)
    proc, address = spawn_server(tmp_path, tiers)
    try:
        with remote(address) as engine:
            assert engine.store(a, kv=hf_kv(a)) == 104
    finally:
        proc.terminate()
        assert proc.wait(30) == 0  # drains the disk writes
    proc, address = spawn_server(tmp_path, tiers)
    try:
        with remote(address, "inline") as engine:
            assert engine.lookup(b) == 48
            assert engine.lookup_and_prefetch(b, "disk").result(10) == 48
            result = engine.retrieve(b[:48], lookup_id="disk")
            assert result.num_tokens == 48 and same_kv(result, b, 48)
            result = engine.retrieve(b)
            assert result.num_tokens == 48 and same_kv(result, b, 48)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_old_style_requests_are_still_served(server) -> None:
    """Clients that send no partial hashes hit whole chunks, as before, alongside
    stores that carry them; a raw request without the new fields is served."""
    a = fresh(96, 27)
    b = a[:75] + fresh(10, 28)  # 80 block-aligned tokens: 2 whole chunks, a 16-token tail
    with remote(server.address) as engine:
        engine.store(a, kv=hf_kv(a))
        keys = engine.chunker.chunk(b).keys
        ends = engine.chunker.chunk(b).ends
        client = engine.client
        assert client.lookup(keys, ends) == 64  # whole chunks only
        assert client.lookup(keys, ends, lookup_id="old") == 64
        views = client.retrieve(keys, lookup_id="old")
        assert [v.shape[2] for v in views] == [CHUNK, CHUNK]
        assert engine.lookup(b) == 64 + 8  # the engine sends them: one block more
        raw = msgspec.msgpack.encode({"op": "lookup", "session": "old-client", "req_id": 3,
                                      "meta": msgspec.to_builtins(engine.meta),
                                      "chunk_hashes": [k.chunk_hash for k in keys],
                                      "chunk_ends": ends, "prefetch": False})
        reply = p.decode_reply(raw_request(server.address, [raw])[-1])
        assert isinstance(reply, p.LookupReply) and reply.hit_tokens == 64


def raw_request(address: str, frames: list[bytes]) -> list[bytes]:
    from tests.server.test_errors import raw_request as send
    return send(address, frames)


@pytest.mark.parametrize("data_path", ["auto", "inline"])
def test_paged_kv_loads_the_leading_blocks_of_a_longer_stored_chunk(server, data_path) -> None:
    """The vLLM case: paged KV, a prompt cut where its lookup's hit ended, whose last
    chunk is served by the whole stored chunk its blocks lead (only those are written)."""
    from tests.engines import test_remote as t

    cfg = t.config(server, data_path, **{"lmkv.block_size": t.BLOCK})
    tokens = t.prompt(40 if data_path == "auto" else 41, 4 * t.CHUNK)
    src, blocks = t.caches(31), list(range(8))
    with t.paged_engine(cfg) as engine:
        assert engine.store(tokens, kv_caches=src, block_ids=blocks) == 4 * t.CHUNK
        split = 2 * t.CHUNK + t.BLOCK + 3  # inside chunk 2, past its first block
        other = tokens[:split] + t.prompt(42, 20)
        hit = 2 * t.CHUNK + t.BLOCK
        assert engine.lookup(other) == hit
        assert engine.lookup_and_prefetch(other, "paged").result(10) == hit
        dst = t.caches(None)
        got = engine.retrieve(other[:hit], lookup_id="paged", kv_caches=dst, block_ids=blocks)
        assert got.num_tokens == hit
        for a, b in zip(t.tokens_kv(src, blocks, hit), t.tokens_kv(dst, blocks, hit),
                        strict=True):
            assert torch.equal(a, b)
        # Nothing past the hit was written: the rest of that chunk stayed out.
        assert all(not dst[layer][b].any() for layer in range(t.L)
                   for b in range(hit // t.BLOCK, 16))
        dst = t.caches(None)
        got = engine.retrieve(other, kv_caches=dst, block_ids=blocks)  # no lookup id
        assert got.num_tokens == hit
        assert all(torch.equal(a, b) for a, b in zip(
            t.tokens_kv(src, blocks, hit), t.tokens_kv(dst, blocks, hit), strict=True))
