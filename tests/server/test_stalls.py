"""Stalled and abandoning clients: a client that copies past the server's timeouts
still gets its own bytes and never writes into another chunk's; requests a client
gave up on, or never finished, do not hold arena memory for good."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from lmkv.rpc import protocol as p
from tests.server.procs import (
    REPO,
    ServerProcess,
    child_env,
    chunk_ends,
    chunk_for,
    prompt_keys,
    same_bytes,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow  # real lmkv server processes

# 64 chunks of 64 KiB; one session may take all of them (server.session_max_bytes).
ARENA = ("tiers:\n  - type: cpu\n    options: {max_bytes: 4MiB}\n"
         "server: {session_max_bytes: 4MiB}\n")
PAUSE_S = 3.0  # past the 1 s session timeout and handle TTL below


@pytest.fixture(scope="module")
def stall_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Short timeouts, a small arena: stalls outlive sessions, and new stores reuse
    every block they can."""
    srv = start_server(tmp_path_factory.mktemp("stalls"), ARENA, "--session-timeout", "1",
                       "--handle-ttl", "1", "--quarantine-grace", "2", name="stalls")
    yield srv
    assert srv.stop() == 0, srv.log()


def server_stats(srv: ServerProcess) -> p.ServerStats:
    with srv.client() as client:
        return client.stats().server


def outside_tier(srv: ServerProcess) -> int:
    """Arena buffers held outside the cpu tier (staged, leased, quarantined)."""
    with srv.client() as client:
        stats = client.stats()
    return stats.server.arena_live_objects - stats.tiers[0]["entries"]


def fill_arena(srv: ServerProcess, first_prompt: int, prompts: int = 32) -> list[int]:
    """Store twice the arena's worth of new chunks: every free or evictable block
    is reused."""
    with srv.client() as client:
        for prompt in range(first_prompt, first_prompt + prompts):
            keys = prompt_keys(prompt)
            client.store(keys, [chunk_for(k) for k in keys])
    return list(range(first_prompt, first_prompt + prompts))


def all_bytes_right(srv: ServerProcess, prompts: list[int]) -> tuple[int, int]:
    """(chunks read, chunks whose bytes are not the key's) over ``prompts``."""
    read = bad = 0
    with srv.client() as client:
        for prompt in prompts:
            keys = prompt_keys(prompt)
            got = client.retrieve(keys)
            read += len(got)
            bad += sum(not same_bytes(t, chunk_for(k)) for t, k in zip(got, keys, strict=False))
    return read, bad


def start_stalled(srv: ServerProcess, mode: str, prompt: int) -> subprocess.Popen:
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.server.worker", mode, srv.address, str(prompt),
         str(PAUSE_S)], stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    assert worker.stdout.readline().strip() == "copying"
    worker.send_signal(signal.SIGSTOP)  # frozen inside its copy: no heartbeat either
    return worker


def resume(worker: subprocess.Popen) -> dict:
    worker.send_signal(signal.SIGCONT)
    line = worker.stdout.readline()
    assert worker.wait(30) == 0
    return json.loads(line)


def test_a_frozen_reader_still_reads_its_own_bytes(stall_server) -> None:
    srv = stall_server
    keys = prompt_keys(10)
    with srv.client() as client:
        assert client.store(keys, [chunk_for(k) for k in keys]) == 4
    worker = start_stalled(srv, "stall-retrieve", 10)
    try:
        # Its session and lease run out; the leased chunks go to the quarantine.
        assert wait_for(lambda: server_stats(srv).quarantined_chunks == 4, timeout_s=10), \
            server_stats(srv)
        fill_arena(srv, 100)
        assert server_stats(srv).quarantined_chunks == 4  # still: the process lives
        outcome = resume(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert outcome == {"got": 4, "bad": 0}
    # Its late release ends the quarantine.
    assert wait_for(lambda: server_stats(srv).quarantined_chunks == 0, timeout_s=5)


def test_a_frozen_writer_never_overwrites_another_chunk(stall_server) -> None:
    srv = stall_server
    worker = start_stalled(srv, "stall-store", 20)
    try:
        assert wait_for(lambda: server_stats(srv).quarantined_chunks == 4, timeout_s=10), \
            server_stats(srv)
        prompts = fill_arena(srv, 200)
        outcome = resume(worker)  # writes prompt 20's bytes into its expired buffers
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert outcome == {"filled": 4, "stored": 0}  # the commit came too late
    read, bad = all_bytes_right(srv, prompts)
    assert read > 0 and bad == 0
    with srv.client() as client:
        assert client.lookup(prompt_keys(20), chunk_ends(prompt_keys(20))) == 0
    assert wait_for(lambda: server_stats(srv).quarantined_chunks == 0, timeout_s=5)
    assert wait_for(lambda: outside_tier(srv) == 0, timeout_s=5)


def test_a_slow_copy_is_kept_alive_by_the_heartbeat(stall_server) -> None:
    srv = stall_server
    keys = prompt_keys(30)
    chunks = [chunk_for(k) for k in keys]
    before = server_stats(srv)
    with srv.client() as client:
        def slow_fill(first: int, buffers: list[torch.Tensor]) -> None:
            time.sleep(PAUSE_S)  # a slow copy, or a long GC pause, in the caller
            for buf, chunk in zip(buffers, chunks[first:], strict=False):
                buf.copy_(chunk)

        assert client.store_from(keys, [c.shape for c in chunks], torch.bfloat16,
                                 slow_fill) == 4
        result: dict[str, int] = {}

        def slow_consume(views: list[torch.Tensor]) -> None:
            time.sleep(PAUSE_S)
            prompts = fill_arena(srv, 300)  # would reuse the lease's blocks if it ended
            result["bad"] = sum(not same_bytes(v, c) for v, c in zip(views, chunks,
                                                                      strict=True))
            result["filler_bad"] = all_bytes_right(srv, prompts)[1]

        assert client.retrieve_into(keys, slow_consume) == 4
        assert result == {"bad": 0, "filler_bad": 0}
        assert client.counters.error_replies == 0
    after = server_stats(srv)
    assert after.expired_handles == before.expired_handles
    assert after.quarantined_chunks == 0
    assert outside_tier(srv) == 0


def test_abandoned_requests_of_a_stalled_server_are_released(stall_server) -> None:
    srv = stall_server
    baseline = outside_tier(srv)
    chunk = chunk_for(prompt_keys(40)[0])
    with srv.client(timeout_ms=200) as client:
        assert client.ping() is not None
        for i in range(10):
            srv.proc.send_signal(signal.SIGSTOP)  # the server stalls past the timeout
            try:
                keys = prompt_keys(400 + i)
                assert client.store(keys, [chunk] * len(keys)) == 0
                assert client.retrieve(prompt_keys(10)) == []
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            assert wait_for(lambda: client.ping() is not None, timeout_s=10)
        assert client.counters.timeouts >= 10
    # Every store it gave up on made staged buffers, and every retrieve a lease, once
    # the server went on; all of them are released, without waiting for a TTL.
    stats = server_stats(srv)
    assert stats.abandoned_handles >= 10
    assert stats.staged_chunks == stats.leased_chunks == stats.quarantined_chunks == 0
    assert outside_tier(srv) == baseline


def test_handles_nobody_finishes_are_released_after_their_ttl(stall_server) -> None:
    srv = stall_server
    baseline = outside_tier(srv)
    before = server_stats(srv).expired_handles
    shape = list(chunk_for(prompt_keys(50)[0]).shape)
    with srv.client() as client:
        for i in range(10):  # 40 of the arena's 64 blocks
            keys = prompt_keys(500 + i)
            # Inline: the client never touches these buffers; shared memory without a
            # process the server can check: quarantined, then freed after the grace.
            data_path = "inline" if i % 2 else "shm"
            got = client._call(p.Store(**p.key_fields(keys), shapes=[shape] * 4,
                                       dtype="bfloat16", data_path=data_path), p.StoreReply)
            assert got is not None and len(got[0].chunks) == 4
        assert client.stats().server.staged_chunks == 40
        assert outside_tier(srv) == baseline + 40
        # The client stays: only the handles' time runs out.
        assert wait_for(lambda: client.stats().server.staged_chunks == 0, timeout_s=10)
        assert client.stats().server.quarantined_chunks == 20
        assert client.stats().server.expired_handles == before + 10
        client.close_connection()  # silent from now on, its session not ended
    assert wait_for(lambda: server_stats(srv).quarantined_chunks == 0, timeout_s=10)
    assert outside_tier(srv) == baseline
