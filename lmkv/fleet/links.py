"""Requests to the fleet's peers: a channel per peer and thread, and each
peer's down time.

A ``Channel`` is one ZMQ socket, used by one thread at a time: each thread
that asks a peer (lookups, gets, pushes) has its own, made on first use and
closed with the tier. A peer that did not answer in time is skipped for
``retry_after_s`` (a stalled peer must not cost every lookup a timeout), and
so is one that could not be reached (every thread would otherwise wait for
its own connection attempt).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from lmkv.contracts.faults import TierFaults
from lmkv.fleet import wire
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import CurveKeys
from lmkv.rpc.channel import Channel, Failure


class PeerLinks:
    def __init__(self, faults: TierFaults, curve: CurveKeys | None, timeout_ms: int,
                 retry_after_s: float, *, max_reply_bytes: int = 256 << 20,
                 context: zmq.Context | None = None) -> None:
        """``max_reply_bytes``: the largest part a peer's answer may hold (a larger
        one makes ZeroMQ drop the connection: a miss)."""
        self.faults = faults
        self.max_reply_bytes = max_reply_bytes
        self.curve = curve
        self.timeout_ms = timeout_ms
        self.retry_after_s = retry_after_s
        self.context = context or zmq.Context.instance()
        self.failures = 0  # requests that got no usable answer (also the tier's errors)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[Channel] = []
        self._down_until: dict[str, float] = {}
        self._closed = False
        self._active = 0  # requests under way
        self._idle = threading.Condition(self._lock)

    def _channel(self, peer: str) -> Channel | None:
        mine: dict[str, Channel] | None = getattr(self._local, "channels", None)
        if mine is None:
            mine = self._local.channels = {}
        channel = mine.get(peer)
        if channel is None:
            with self._lock:
                if self._closed:
                    return None
                channel = Channel(peer, self.context, self.curve,
                                  decode_reply=wire.decode_peer_reply,
                                  max_reply_bytes=self.max_reply_bytes)
                self._all.append(channel)
            mine[peer] = channel
        return channel

    def is_down(self, peer: str) -> bool:
        until = self._down_until.get(peer)
        return until is not None and time.monotonic() < until

    def request(self, peer: str, message: p.Request, parts: Sequence[Any] = ()
                ) -> tuple[Any, list[zmq.Frame]] | None:
        """The peer's reply and its data parts; None when it gave none in time, or
        answered with an error (counted in ``failures``)."""
        if self.is_down(peer):
            return None
        channel = self._channel(peer)
        if channel is None:
            return None
        with self._lock:
            if self._closed:
                return None
            self._active += 1
        got: tuple[Any, list[zmq.Frame]] | Failure | zmq.ZMQError
        try:
            got = channel.request(message, parts, self.timeout_ms)
        except zmq.ZMQError as exc:  # no socket to be had (descriptors, a closed context)
            channel.reset()
            got = exc
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()
        if isinstance(got, (Failure, zmq.ZMQError)):
            # Down for a while either way: every thread's channel would otherwise
            # pay its own wait to find out.
            self._down_until[peer] = time.monotonic() + self.retry_after_s
            what = got.value if isinstance(got, Failure) else f"socket error ({got})"
            self._failed(peer, f"{what}; misses from it for {self.retry_after_s:g} s")
            return None
        if isinstance(got[0], p.ErrorReply):
            self._failed(peer, f"refused a {message.__struct_config__.tag} "
                         f"({got[0].code}: {got[0].reason})")
            return None
        self._down_until.pop(peer, None)
        return got

    def _failed(self, peer: str, what: str) -> None:
        self.failures += 1
        self.faults.counters.errors += 1
        self.faults.note(f"peer {peer}", "peer %s %s", peer, what)

    def close(self) -> None:
        """No new requests; those under way end by their deadline, then every
        channel closes (a socket is closed by no other thread while one uses it)."""
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: not self._active, self.timeout_ms / 1000 + 1)
            if self._active:  # (not expected: each request has a deadline) left to the GC
                return
            channels, self._all = self._all, []
        for channel in channels:
            channel.close()
