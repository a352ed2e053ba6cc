"""lmkv.rpc.handshake: what a client says when its connection never completes."""

from __future__ import annotations

import socket
import threading
import time

from lmkv.rpc.client import ServerClient


def test_a_peer_that_accepts_and_never_greets_is_waited_for_within_the_bound() -> None:
    """A connection made whose handshake never ends (a listener that is not an lmkv
    server, or one too busy to answer): the wait for its outcome ends at
    ``wait_ms`` and names no mismatch."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        with ServerClient(f"tcp://127.0.0.1:{port}", timeout_ms=200, data_path="inline") as client:
            assert client.stats() is None
            started = time.monotonic()
            assert client.connection_problem(wait_ms=300) == ""
            assert time.monotonic() - started < 30  # bounded (a liveness bound, not a timing)
            assert client.connection_problem() == ""  # no wait asked: none made
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


def test_no_server_there_is_said_without_waiting_for_a_handshake() -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with ServerClient(f"tcp://127.0.0.1:{port}", timeout_ms=200, data_path="inline") as client:
        assert client.stats() is None
        started = time.monotonic()
        assert client.connection_problem(wait_ms=60_000) == ""
        assert time.monotonic() - started < 30  # no connection made: nothing waited for

