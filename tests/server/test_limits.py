"""One client cannot take the server's arena from the others: what a session holds is
limited (quarantined buffers included), and the process a client names for its
quarantine is checked, never trusted. Real server processes; the misbehaving
client is a process of its own (``tests.server.worker hog``): it asks for buffers
for 40 prompts, names pid 1 (which never exits) as itself, commits nothing and
goes silent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lmkv.rpc import protocol as p
from tests.server.procs import (
    REPO,
    ServerProcess,
    child_env,
    chunk_for,
    prompt_keys,
    same_bytes,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow  # real lmkv server and client processes

# 64 chunks of 64 KiB; a session may hold half: 32 chunks.
ARENA = "tiers:\n  - type: cpu\n    options: {max_bytes: 4MiB}\n"
HOG_STORES = 40  # 4 chunks each: 160 chunks asked for


def server_stats(srv: ServerProcess) -> p.ServerStats:
    with srv.client() as client:
        return client.stats().server


@contextmanager
def hog(srv: ServerProcess) -> Iterator[tuple[subprocess.Popen, dict]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.worker", "hog", srv.address, str(HOG_STORES)],
        stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        line = proc.stdout.readline()  # bounded: its requests time out, or it exits
        assert line, f"the hog exited ({proc.wait(30)})"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdout.close()


def well_behaved_client_stores_and_loads(srv: ServerProcess, first_prompt: int) -> None:
    """20 prompts of 4 chunks, each stored and read back whole: more than the room the
    hog left, so the stores evict each other's older prompts, never fail."""
    with srv.client() as client:
        for prompt in range(first_prompt, first_prompt + 20):
            keys = prompt_keys(prompt)
            chunks = [chunk_for(k) for k in keys]
            assert client.store(keys, chunks) == len(keys), client.counters
            got = client.retrieve(keys)
            assert len(got) == len(keys) and all(map(same_bytes, got, chunks))
        assert client.counters.dropped_chunks == client.counters.error_replies == 0


def test_a_silent_client_naming_pid_1_cannot_starve_another_and_its_ipc_peer_is_checked(
        tmp_path: Path) -> None:
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    srv = start_server(tmp_path, ARENA, "--handle-ttl", "0.5", socket_dir=sockets,
                       name="limits-ipc")
    try:
        with hog(srv) as (proc, got):
            # Its session's share, then refusals; the rest of the arena stays others'.
            assert got == {"granted": 32, "refused": 32, "error_replies": 32}
            # Its buffers expire into the quarantine, held for its process: the one the
            # ipc socket's peer credentials name, not the pid 1 it claims.
            assert wait_for(lambda: server_stats(srv).quarantined_chunks == 32), \
                server_stats(srv)
            well_behaved_client_stores_and_loads(srv, 900)
            stats = server_stats(srv)
            assert stats.quarantined_chunks == 32 and stats.over_limit >= 32
            assert f"names process 1, but its ipc socket's peer is pid {proc.pid}" \
                in srv.log()
            proc.kill()
            proc.wait(30)
            # That process is gone: the quarantine ends, although pid 1 lives on.
            assert wait_for(lambda: server_stats(srv).quarantined_chunks == 0), \
                server_stats(srv)
    finally:
        assert srv.stop() == 0, srv.log()


def test_on_tcp_a_named_process_that_does_not_map_the_arena_is_not_taken(
        tmp_path: Path) -> None:
    srv = start_server(tmp_path, ARENA, "--handle-ttl", "0.5", "--quarantine-grace", "2",
                       name="limits-tcp")
    try:
        with hog(srv) as (proc, got):
            assert got == {"granted": 32, "refused": 32, "error_replies": 32}
            well_behaved_client_stores_and_loads(srv, 950)
            assert "that does not map this server's arena: not taken" in srv.log()
            # Pid 1 lives, and so does the hog; but the hog is silent, and nothing it
            # named could be checked: its buffers are freed after the grace period.
            assert wait_for(lambda: server_stats(srv).quarantined_chunks == 0), \
                server_stats(srv)
            assert proc.poll() is None
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_session_past_its_limits_gets_fewer_chunks_then_a_refusal(tmp_path: Path) -> None:
    config = ARENA + "server: {session_max_bytes: 256KiB, session_max_handles: 2}\n"
    srv = start_server(tmp_path, config, name="limits-small")
    try:
        keys = prompt_keys(60, chunks=8)
        chunks = [chunk_for(k) for k in keys]
        with srv.client() as client:
            # 8 chunks in one store, 4 within the limit: those are stored, and the rest
            # dropped as if the arena were full.
            assert client.store(keys, chunks) == 4
            assert client.counters.dropped_chunks == 4 and client.counters.over_limit == 0
            stored = keys[:4]
            # A lease the client keeps holds the session's whole byte limit ...
            lease = client._call(p.Retrieve(**p.key_fields(stored), data_path="shm"),
                                 p.RetrieveReply)
            assert lease is not None and len(lease[0].chunks) == 4
            # ... so another retrieve is refused (a miss, counted), not served from
            # someone else's room.
            assert client.retrieve(stored) == []
            assert client.counters.over_limit == 1
            assert "its retrieve is refused" in srv.log()
            assert client._call(p.Release(handle=lease[0].handle), p.ReleaseReply)
            got = client.retrieve(stored)
            assert len(got) == 4 and all(map(same_bytes, got, chunks))
            assert client.stats().server.over_limit == 2
    finally:
        assert srv.stop() == 0, srv.log()
