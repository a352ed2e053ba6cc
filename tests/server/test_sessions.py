"""Sessions: what a client holds on the server is released when it ends the session,
or when it vanishes and its lease runs out."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from lmkv.rpc import protocol as p
from lmkv.server.sessions import MAX_LOOKUPS_PER_SESSION
from tests.server.procs import (
    REPO,
    child_env,
    chunk_ends,
    chunk_for,
    prompt_keys,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow  # real lmkv server processes


def held(stats: p.StatsReply) -> tuple[int, int, int, int]:
    """(held lookups, staged chunks, leased chunks, arena buffers outside the tier)."""
    s = stats.server
    return (s.held_lookups, s.staged_chunks, s.leased_chunks,
            s.arena_live_objects - stats.tiers[0]["entries"])


def test_end_session_releases_prefetches_staged_buffers_and_leases(server) -> None:
    keys = prompt_keys(300)
    chunks = [chunk_for(k) for k in keys]
    with server.client() as client, server.client() as observer:
        client.store(keys, chunks)
        assert client.lookup(keys, chunk_ends(keys), lookup_id="kept") > 0
        staged = prompt_keys(301)
        assert client._call(p.Store(**p.key_fields(staged), shapes=[list(chunks[0].shape)] * 4,
                                    dtype="bfloat16"), p.StoreReply) is not None
        assert client._call(p.Retrieve(**p.key_fields(keys)), p.RetrieveReply) is not None
        assert held(observer.stats()) == (1, 4, 4, 4)  # staged buffers are new
        ended = client.end_session()
        assert (ended.lookups, ended.chunks) == (1, 8)
        assert held(observer.stats()) == (0, 0, 0, 0)
        # Nothing is pinned or referenced any more: a chunk as large as the whole
        # arena evicts every entry and fits.
        whole = torch.full((64 << 20,), 7, dtype=torch.uint8)
        assert observer.store(prompt_keys(302, chunks=1), [whole]) == 1


def test_prefetch_status_follows_a_lookup_without_waiting(server) -> None:
    keys = prompt_keys(310)
    with server.client() as client:
        client.store(keys[:3], [chunk_for(k) for k in keys[:3]])
        assert client.start_lookup(keys, chunk_ends(keys), "async")
        status = wait_for(lambda: client.prefetch_status("async") is not None)
        assert client.prefetch_status("async") == chunk_ends(keys)[2] and status
        assert client.prefetch_status("never-started") == -1
        assert client.stats().server.held_lookups == 1
        client.release_lookup("async")
        assert client.prefetch_status("async") == -1
        assert client.stats().server.held_lookups == 0


@pytest.fixture
def short_lease_server(tmp_path):
    srv = start_server(tmp_path, None, "--session-timeout", "1", name="lease")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_killed_clients_memory_is_released_when_its_lease_runs_out(short_lease_server
                                                                     ) -> None:
    srv = short_lease_server
    engine = subprocess.Popen([sys.executable, "-m", "tests.server.worker", "hold", srv.address],
                              stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        assert engine.stdout.readline().strip() == "held"
        with srv.client() as observer:
            assert held(observer.stats()) == (1, 4, 4, 4)
            engine.send_signal(signal.SIGKILL)
            engine.wait(10)
            released = wait_for(lambda: held(observer.stats()) == (0, 0, 0, 0), timeout_s=10)
            assert released, observer.stats()
            assert observer.stats().server.expired_sessions >= 1
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_a_session_holds_a_bounded_number_of_prefetches(server) -> None:
    keys = prompt_keys(320, chunks=1)
    with server.client() as client:
        client.store(keys, [chunk_for(keys[0])])
        dropped = client.stats().server.dropped_lookups
        for i in range(MAX_LOOKUPS_PER_SESSION + 5):
            assert client.lookup(keys, [16], lookup_id=f"never-retrieved-{i}") == 16
        stats = client.stats().server
        assert stats.held_lookups == MAX_LOOKUPS_PER_SESSION
        assert stats.dropped_lookups == dropped + 5
        assert client.prefetch_status("never-retrieved-0") == -1  # the oldest went first
        assert client.prefetch_status(f"never-retrieved-{MAX_LOOKUPS_PER_SESSION}") == 16
