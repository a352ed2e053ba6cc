"""Why a ZMQ connection never completed its handshake, in a user's words.

A client whose security does not match the server's (no CURVE against a CURVE
server, a key the server does not admit, the wrong server key) never gets a
connection: with ``IMMEDIATE`` that looks exactly like no server at all. ZMQ
reports the failed handshake on the socket's monitor; ``HandshakeWatch``
reads those events when asked (after a failed request, or from the server's
loop), so that the one line a user sees names the mismatch, not an absent
server.
"""

from __future__ import annotations

import contextlib
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_DISCONNECTED)
# A connection under way (TCP connecting, or connected and greeting) / ended without
# a handshake outcome (refused, dropped: nothing more to wait for).
_UNDER_WAY = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED
_GONE = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
# Events a watch reads at once at most: a peer retrying a failing handshake adds
# some per reconnect, and reading them must stay cheap.
_MAX_EVENTS = 256

#: The peer spoke another security mechanism (CURVE against plain ZMQ, or back).
MECHANISM_MISMATCH = "mechanism_mismatch"
#: The peer's authenticator refused this side's key.
KEY_REFUSED = "key_refused"
#: The CURVE handshake failed without saying why (for a client: the server's key
#: is not the one it was given).
CURVE_FAILED = "curve_failed"


class HandshakeWatch:
    """The handshake outcomes of one socket; ``failure()`` says the latest failure."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._monitor: zmq.Socket | None = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._failure: str | None = None
        # A connection under way whose handshake has not ended yet (a busy peer, or a
        # busy machine, may take longer than the request that gave up on it).
        self._pending = False

    @property
    def monitor(self) -> zmq.Socket | None:
        """The socket the events arrive on (to poll), None once closed."""
        return self._monitor

    def failures(self) -> list[str]:
        """The handshake failures seen since the last call (oldest first); a
        handshake that succeeded meanwhile clears the ones before it."""
        seen: list[str] = []
        monitor = self._monitor
        if monitor is None:
            return seen
        for _ in range(_MAX_EVENTS):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind & (_UNDER_WAY | _GONE):
                self._pending = bool(kind & _UNDER_WAY)
                continue
            self._pending = False
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                seen.clear()
                self._failure = None
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                seen.append(KEY_REFUSED)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                    event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                seen.append(MECHANISM_MISMATCH)
            else:
                seen.append(CURVE_FAILED)
        if seen:
            self._failure = seen[-1]
        return seen

    def failure(self, wait_ms: int = 0) -> str | None:
        """The latest handshake failure, unless a handshake succeeded since.
        ``wait_ms``: while a connection is under way (connecting, or connected and
        its handshake not ended), wait up to that long for how it ends (nothing is
        waited for once it was refused or dropped: no server there)."""
        self.failures()
        monitor = self._monitor
        if wait_ms > 0 and monitor is not None:
            deadline = time.monotonic() + wait_ms / 1e3
            while self._pending and (left := deadline - time.monotonic()) > 0:
                if monitor.poll(int(left * 1e3) + 1, zmq.POLLIN):
                    self.failures()
        return self._failure

    def close(self) -> None:
        if self._monitor is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._monitor = None


def client_problem(failure: str | None, has_curve: bool) -> str:
    """What a client tells its user about ``failure`` ("" for none)."""
    if failure == MECHANISM_MISMATCH:
        return ("the server wants CURVE: give this client the CURVE keys of server.curve "
                "(docs/security.md)" if not has_curve else
                "the server does not use CURVE, but this client has server.curve keys")
    if failure == KEY_REFUSED:
        return "the server refused this client's CURVE key (not among its authorized keys)"
    if failure == CURVE_FAILED and has_curve:
        return ("the CURVE handshake failed: is server.curve.server_key this server's "
                "public key?")
    if failure == CURVE_FAILED:
        # A CURVE server that hangs up on a plain greeting before its error reaches
        # the client (which of the two a client sees is a matter of timing).
        return ("the server ended the handshake: it wants CURVE (give this client the "
                "CURVE keys of server.curve, docs/security.md), or it is not an lmkv "
                "server")
    return ""
