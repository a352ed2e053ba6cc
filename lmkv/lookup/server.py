"""Worker side of the lookup channel: requests in, prefetches started, hit counts out.

A background thread receives ``LookupRequest`` and ``LookupCleanup`` frames.
A request starts ``engine.lookup_and_prefetch_hashes`` (the storage manager
pins, fetches and holds the chunks under the lookup id) and returns at once:
the answer is sent from the prefetch future's done-callback, so a slow
prefetch never holds up the next request. A full miss resolves at once and
answers 0. Every request is answered exactly once (0 when it cannot be
served), which lets the client account for answers to cancelled lookups.

A cleanup calls ``engine.release_lookup``: the prefetched chunks are released
now, or as soon as a prefetch still in flight finishes. A later
``engine.retrieve(tokens, lookup_id=...)`` consumes them instead.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import zmq

from lmkv.auth import CurveKeys, CurveServer
from lmkv.logutil import RateLimitedLog
from lmkv.lookup.messages import (
    LookupCleanup,
    LookupRequest,
    LookupResponse,
    decode_frame,
    encode,
)
from lmkv.lookup.transport import (
    LookupEndpoints,
    Waker,
    close_all,
    last_endpoint,
    pull_socket,
    push_socket,
)

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

CLOSE_TIMEOUT_S = 2.0


class PrefetchingEngine(Protocol):
    """What the server needs of an engine (``lmkv.CacheEngine`` has it)."""

    def lookup_and_prefetch_hashes(self, lookup_id: str, chunk_hashes: list[bytes],
                                   chunk_ends: list[int]) -> Future: ...

    def release_lookup(self, lookup_id: str) -> None: ...


@dataclass
class ServerCounters:
    requests: int = 0
    answers: int = 0
    cleanups: int = 0
    rejected_frames: int = 0  # malformed, foreign or unexpected messages
    failed_sends: int = 0  # answers the response socket refused (client gone, queue full)


class LookupServer:
    """Serves one worker's engine on ``request_endpoint``; answers to ``response_endpoint``.

    ``request_endpoint`` is bound (``tcp://host:*`` picks a free port; see
    ``request_endpoint`` afterwards); ``response_endpoint`` is the client's,
    connected to (it may come up later). The thread starts at construction.
    """

    def __init__(self, engine: PrefetchingEngine, request_endpoint: str,
                 response_endpoint: str, curve: CurveKeys | None = None) -> None:
        self.engine = engine
        self.counters = ServerCounters()
        self._context = zmq.Context()
        self._auth = CurveServer(self._context, curve) if curve is not None else None
        self._requests = pull_socket(self._context, request_endpoint, curve=self._auth)
        self._responses = push_socket(self._context, response_endpoint, curve=curve)
        self.request_endpoint = last_endpoint(self._requests)
        self._send_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._waker = Waker(self._context)
        self._thread = threading.Thread(target=self._run, name="lmkv-lookup-server",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def for_rank(cls, engine: PrefetchingEngine, endpoints: LookupEndpoints,
                 rank: int) -> LookupServer:
        if not 0 <= rank < endpoints.world_size:
            raise ValueError(f"rank {rank}: the channel has ranks 0..{endpoints.world_size - 1}")
        return cls(engine, endpoints.requests[rank], endpoints.responses, endpoints.curve)

    # -- receiving -------------------------------------------------------------
    def _run(self) -> None:
        sock = self._requests
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if sock not in dict(poller.poll()):
                    continue
                while True:
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(parts)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                _log.log(logging.ERROR, "recv", "lmkv lookup server: receive failed: %s", exc)
            except Exception:  # a bug; the thread must keep serving
                logger.exception("lmkv lookup server: unexpected error")

    def _handle(self, parts: list[bytes]) -> None:
        if len(parts) != 1:
            self._reject("multipart", "a %d-part message", len(parts))
            return
        message = decode_frame(parts[0], "server")
        if isinstance(message, LookupRequest):
            self._start(message)
        elif isinstance(message, LookupCleanup):
            self.counters.cleanups += 1
            self.engine.release_lookup(message.lookup_id)
        elif message is None:
            self.counters.rejected_frames += 1
        else:
            self._reject("unexpected", "a %s (workers take requests and cleanups)",
                         type(message).__name__)

    def _reject(self, key: str, what: str, *args: object) -> None:
        self.counters.rejected_frames += 1
        _log.log(logging.ERROR, f"reject:{key}", "lmkv lookup server: rejected " + what, *args)

    def _start(self, request: LookupRequest) -> None:
        self.counters.requests += 1
        if request.request_configs:
            logger.debug("lmkv lookup %s: ignoring request_configs %s", request.lookup_id,
                         sorted(request.request_configs))
        try:
            future = self.engine.lookup_and_prefetch_hashes(
                request.lookup_id, request.hashes, request.offsets)
        except Exception as exc:  # the engine refused: answer a miss, keep serving
            _log.log(logging.ERROR, "engine", "lmkv lookup %s: prefetch failed: %s",
                     request.lookup_id, exc)
            self._answer(request.lookup_id, 0)
            return
        future.add_done_callback(partial(self._prefetched, request.lookup_id))

    # -- answering -------------------------------------------------------------
    def _prefetched(self, lookup_id: str, future: Future) -> None:
        """Runs in the storage manager's prefetch thread (or at once when already done)."""
        try:
            hits = int(future.result())
        except BaseException as exc:  # cancelled or failed: a miss
            _log.log(logging.ERROR, "result", "lmkv lookup %s: prefetch failed: %s",
                     lookup_id, exc)
            hits = 0
        self._answer(lookup_id, max(hits, 0))

    def _answer(self, lookup_id: str, hits: int) -> None:
        frame = encode(LookupResponse(lookup_id, hits))
        with self._send_lock:
            if self._closed:
                return
            try:
                self._responses.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.counters.failed_sends += 1
                _log.log(logging.ERROR, "send",
                         "lmkv lookup server: could not answer %s: %s", lookup_id, exc)
                return
        self.counters.answers += 1

    # -- the rest --------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return dict(vars(self.counters))

    def close(self) -> None:
        """Stop serving. Prefetched chunks stay with the engine (``engine.close`` frees them)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        self._thread.join(CLOSE_TIMEOUT_S)
        with self._send_lock:
            self._closed = True
            if self._thread.is_alive():  # never close a socket a live thread uses
                logger.warning("lmkv lookup server: receive thread did not stop; leaving it")
                return
            close_all([self._requests, self._responses])
        self._waker.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    def __enter__(self) -> LookupServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
