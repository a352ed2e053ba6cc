"""lmkv.rpc.handshake: what a client says when its connection never completes."""

from __future__ import annotations

import socket
import threading
import time

from lmkv.rpc.client import ServerClient


def _terminates(context) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``context`` terminates within a bound (it waits for every socket)."""
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(30)
    return not ended.is_alive()


def _closed_port() -> int:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    return port


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
    port = _closed_port()
    with ServerClient(f"tcp://127.0.0.1:{port}", timeout_ms=200, data_path="inline") as client:
        assert client.stats() is None
        started = time.monotonic()
        assert client.connection_problem(wait_ms=60_000) == ""
        assert time.monotonic() - started < 30  # no connection made: nothing waited for



def test_an_idle_client_whose_server_is_gone_never_stops_its_contexts_connections(
        monkeypatch) -> None:
    """ZMQ's I/O thread sends monitor events with a send that waits while their queue
    is full: an idle client retrying a server that is gone must not fill it, or every
    connection of the context stops for good. Retries every millisecond here make
    in seconds the thousands of events that half-second retries make in minutes."""
    import zmq

    from lmkv.rpc import channel

    monkeypatch.setattr(channel, "RECONNECT_IVL_MS", 1)
    monkeypatch.setattr(channel, "RECONNECT_IVL_MAX_MS", 1)
    context = zmq.Context()
    other = zmq.Context()
    port = _closed_port()
    router = other.socket(zmq.ROUTER)
    fresh = context.socket(zmq.DEALER)
    try:
        with ServerClient(f"tcp://127.0.0.1:{port}", timeout_ms=200, data_path="inline",
                          context=context) as idle:
            assert idle.ping() is None
            watch = idle._channel._watch
            assert watch is not None
            # More than the queue a monitor has by default (about 2,000 events): the
            # old way, this many unread events stopped the I/O thread.
            deadline = time.monotonic() + 120
            while watch.events_read < 3000 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watch.events_read >= 3000, watch.events_read
            # Another socket of the same context still connects...
            elsewhere = router.bind_to_random_port("tcp://127.0.0.1")
            fresh.setsockopt(zmq.IMMEDIATE, 1)
            fresh.setsockopt(zmq.LINGER, 0)
            fresh.connect(f"tcp://127.0.0.1:{elsewhere}")
            assert fresh.poll(30_000, zmq.POLLOUT)
            # ...and the idle client connects by itself once something listens.
            router.unbind(f"tcp://127.0.0.1:{elsewhere}")
            router.bind(f"tcp://127.0.0.1:{port}")
            sock = idle._channel._socket
            assert sock is not None and sock.poll(30_000, zmq.POLLOUT)
        # Closed, the client leaves nothing open: the context terminates.
        fresh.close(linger=0)
        assert _terminates(context), "the context did not terminate: a socket left open"
    finally:
        fresh.close(linger=0)
        router.close(linger=0)
        other.term()
        if not context.closed:  # (the test failed before: its sockets go with it)
            context.destroy(linger=0)



def test_a_watch_left_open_neither_holds_its_context_nor_stops_the_others() -> None:
    """A context terminated while a watch on one of its sockets was never closed:
    the reader closes that monitor (the context ends) and reads the others on."""
    import zmq

    from lmkv.rpc.handshake import HandshakeWatch

    doomed, healthy = zmq.Context(), zmq.Context()
    left = doomed.socket(zmq.DEALER)
    _open_watch = HandshakeWatch(left)  # never closed
    left.close(linger=0)
    assert _terminates(doomed)
    sock = healthy.socket(zmq.DEALER)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    watch = HandshakeWatch(sock)
    try:
        sock.connect(f"tcp://127.0.0.1:{_closed_port()}")
        deadline = time.monotonic() + 30
        while watch.events_read == 0 and time.monotonic() < deadline:
            watch.failure()
        assert watch.events_read > 0  # still read: the reader went on
    finally:
        watch.close()
        sock.close(linger=0)
    assert _terminates(healthy)
    del _open_watch  # (held to here: collected, it would be closed, not left open)


def test_a_watch_dropped_unclosed_lets_its_context_end() -> None:
    import gc

    import zmq

    from lmkv.rpc.handshake import HandshakeWatch

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    watch = HandshakeWatch(sock)
    sock.connect(f"tcp://127.0.0.1:{_closed_port()}")
    del watch
    gc.collect()
    sock.close(linger=0)
    assert _terminates(context)
