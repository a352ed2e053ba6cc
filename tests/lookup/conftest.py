"""Two real worker processes (spawned), each with its own LocalEngine and cpu tier,
serving the lookup channel over ipc:// and tcp://; clients are made per test."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from lmkv.engines.local import LocalEngine
from lmkv.lookup import LookupClient, LookupEndpoints, LookupResponder
from tests.lookup import worker_proc

CHUNK = 32
ENGINE_ID = "test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (a tcp channel's
    ``base_port``), below the kernel's ephemeral range so no outgoing connection
    takes one meanwhile."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32000 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll ``predicate`` until it returns a true value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def poll_result(client: LookupClient, lookup_id: str, timeout: float = 15.0) -> int:
    """Poll until the lookup is no longer pending (a deadline, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while (result := client.poll(lookup_id)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"lookup {lookup_id} still pending after {timeout} s")
    return result


def all_threads_stopped(pid: int) -> bool:
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for task in tasks.iterdir():
        with suppress(FileNotFoundError):  # a thread that just ended
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    return bool(states) and all(state in "tT" for state in states)


def prompt(seed: int, chunks: int) -> list[int]:
    return [seed * 100_000 + i for i in range(chunks * CHUNK)]


@dataclass
class Worker:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection
    ipc: str
    tcp: str

    def call(self, *command: Any, timeout: float = 30.0) -> Any:
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker {self.rank} did not answer {command[0]!r}")
        return self.conn.recv()

    def state(self) -> dict[str, Any]:
        return self.call("state")

    def is_clean(self) -> bool:
        s = self.state()
        return s["pins"] == 0 and s["extra_refs"] == 0 and s["lookups_held"] == 0

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """SIGSTOP the process for the block (SIGCONT however the block ends)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            # The group stop completes only once a thread takes the signal: until
            # then the other threads run on (for a while, on a loaded machine).
            wait_for(lambda: all_threads_stopped(self.process.pid),
                     f"worker {self.rank} to stop")
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


@dataclass
class Workers:
    ranks: list[Worker]
    ipc: LookupEndpoints
    tcp: LookupEndpoints

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.ranks)

    def __getitem__(self, rank: int) -> Worker:
        return self.ranks[rank]


@pytest.fixture(scope="package")
def workers() -> Iterator[Workers]:
    runtime_dir = tempfile.mkdtemp(prefix="lmkv-", dir="/tmp" if os.path.isdir("/tmp") else None)
    ipc = LookupEndpoints.ipc(ENGINE_ID, 2, runtime_dir)
    tcp_responses = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    started = []
    for rank in range(2):
        parent, child = ctx.Pipe()
        endpoints = [(ipc.requests[rank], ipc.responses), ("tcp://127.0.0.1:*", tcp_responses)]
        process = ctx.Process(target=worker_proc.serve, args=(child, rank, endpoints, CHUNK),
                              daemon=True, name=f"lookup-worker-{rank}")
        process.start()
        started.append((rank, process, parent))
    ranks = []
    for rank, process, conn in started:
        if not conn.poll(120):
            raise RuntimeError(f"worker {rank} did not start")
        ipc_endpoint, tcp_endpoint = conn.recv()
        ranks.append(Worker(rank, process, conn, ipc_endpoint, tcp_endpoint))
    tcp = LookupEndpoints(tuple(w.tcp for w in ranks), tcp_responses)
    yield Workers(ranks, ipc, tcp)
    for worker in ranks:
        with suppress(AssertionError, OSError):
            worker.call("stop", timeout=10)
        worker.process.join(5)
        if worker.process.is_alive():
            worker.process.kill()
    shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.fixture
def make_client(workers: Workers) -> Iterator[Callable[..., LookupClient]]:
    """Clients on the package's workers; after the test, every worker must be back
    to no pins, no references beyond its tier's own and no lookup held."""
    made: list[LookupClient] = []

    def make(transport: str = "ipc", **settings: Any) -> LookupClient:
        settings.setdefault("timeout_ms", 30_000)  # tests that time out set their own
        endpoints = workers.ipc if transport == "ipc" else workers.tcp
        client = LookupClient(endpoints, chunk_size=CHUNK, **settings)
        made.append(client)
        return client

    yield make
    try:
        for worker in workers:
            wait_for(worker.is_clean, f"worker {worker.rank} to release every pin and reference")
    finally:
        for client in made:
            client.close()


@pytest.fixture
def engine() -> Iterator[LocalEngine]:
    """A worker's engine in this process (rank 0, a small cpu tier)."""
    engine = worker_proc.make_engine(CHUNK, 1 << 22, rank=0)
    yield engine
    engine.close()


@pytest.fixture
def endpoints() -> Iterator[LookupEndpoints]:
    """A one-worker ipc channel of its own."""
    with tempfile.TemporaryDirectory(prefix="lmkv-", dir="/tmp") as runtime_dir:
        yield LookupEndpoints.ipc("inproc", 1, runtime_dir)


@pytest.fixture
def responder(engine: LocalEngine, endpoints: LookupEndpoints) -> Iterator[LookupResponder]:
    """``engine`` served on ``endpoints`` from this process."""
    with LookupResponder.for_rank(engine, endpoints, 0) as responder:
        yield responder
