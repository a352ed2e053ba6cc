from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.server.procs import ServerProcess, start_server

MAX_REQUEST_BYTES = 1 << 20
WHOLE_ARENA_SESSIONS = ("tiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n"
                        "server: {session_max_bytes: 64MiB}\n")


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the tests that do not stop it: a 64 MiB cpu tier in shared memory,
    requests limited to 1 MiB; a session may hold the whole arena (tests store a
    chunk as large as all of it to show that nothing else is held)."""
    srv = start_server(tmp_path_factory.mktemp("server"), WHOLE_ARENA_SESSIONS,
                       "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield srv
    code = srv.stop(signal.SIGTERM)
    assert code == 0, srv.log()
