"""Worker side of the lookup channel: requests in, prefetches started, hit counts out.

A background thread receives ``LookupRequest`` and ``LookupCleanup`` messages.
A request starts ``engine.lookup_and_prefetch_hashes`` (the storage manager
pins, fetches and holds the chunks under the lookup id) and returns at once:
the answer is sent from the prefetch future's done-callback, so a slow
prefetch never holds up the next request. A full miss resolves at once and
answers 0. Every request is answered exactly once (0 when it cannot be
served), which lets the client account for answers to cancelled lookups.

Bounds (a peer must not make a worker allocate or stall):

* a request of more than ``max_chunks`` chunks is answered 0 without being
  decoded beyond its id (a message too long to hold ``max_chunks`` chunks is not
  decoded at all); a message over four times that disconnects its sender;
* requests of more than ``BULK_CHUNKS`` chunks are started by a second thread
  (the bulk lane), so building the keys of a long prompt never delays the
  short ones behind it; at most ``BULK_QUEUE_CHUNKS_FACTOR * max_chunks``
  chunks wait there, and at most ``INFLIGHT_CHUNKS_FACTOR * max_chunks``
  chunks are being prefetched at once: beyond either, a request is shed
  (answered 0, counted);
* what a finished prefetch holds is released by the engine after its
  unclaimed TTL on a timer (``lmkv.storage.prefetch``), with no further lookup needed.

A cleanup calls ``engine.release_lookup``: the prefetched chunks are released
now, or as soon as a prefetch still in flight finishes. A cleanup for a request
still queued in the bulk lane drops it (it answers 0 and is never started). A
later ``engine.retrieve(tokens, lookup_id=...)`` consumes them instead.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import zmq

from lmkv.base import affinity
from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LookupConfig
from lmkv.engines.protocol import Engine
from lmkv.keys.chunking import DEFAULT_CHUNK_SIZE
from lmkv.lookup import local
from lmkv.lookup.messages import (
    LookupCleanup,
    LookupRequest,
    LookupResponse,
    decode_message,
    decode_request_head,
    encode,
    max_chunks_for,
    max_request_bytes,
)
from lmkv.lookup.sockets import (
    LookupEndpoints,
    Waker,
    close_all,
    last_endpoint,
    prepare_bind,
    pull_socket,
    push_socket,
)
from lmkv.rpc.auth import CurveAuthenticator, CurveKeys

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

CLOSE_TIMEOUT_S = 2.0
# Requests up to this many chunks are started on the receiving thread (building
# their keys costs well under a millisecond); longer ones go to the bulk lane.
BULK_CHUNKS = 512
BULK_QUEUE_CHUNKS_FACTOR = 4
INFLIGHT_CHUNKS_FACTOR = 8
# Messages between the largest valid request and this many times it are answered
# 0 from their id; larger ones never reach the responder (ZMQ MAXMSGSIZE).
MESSAGE_LIMIT_FACTOR = 4
DEFAULT_MAX_CHUNKS = max_chunks_for(LookupConfig.model_fields["max_tokens"].default,
                                    DEFAULT_CHUNK_SIZE)


def _unexpected(exc: Exception) -> None:
    _log.log(logging.ERROR, "bug", "lmkv lookup responder: unexpected error: %r", exc)
    logger.debug("lmkv lookup responder: unexpected error", exc_info=exc)


@dataclass
class ResponderCounters:
    requests: int = 0
    answers: int = 0
    cleanups: int = 0
    rejected_messages: int = 0  # malformed, foreign or unexpected messages
    failed_sends: int = 0  # answers the response socket refused (client gone, queue full)
    oversize: int = 0  # requests over max_chunks, answered 0 unread
    shed: int = 0  # requests answered 0 because the bulk lane or the prefetches were full
    dropped_queued: int = 0  # bulk requests a cleanup reached before they started


#: Where an answer goes when the request came as a call (``LookupResponder.ask``).
Reply = Callable[[LookupResponse], None]


@dataclass
class _Queued:
    request: LookupRequest
    reply: Reply | None = None
    cancelled: bool = False


class LookupResponder:
    """Serves one worker's engine on ``request_endpoint``; answers to ``response_endpoint``.

    ``request_endpoint`` is bound (``tcp://host:*`` picks a free port; see
    ``request_endpoint`` afterwards); ``response_endpoint`` is the client's,
    connected to (it may come up later). ``rank`` is put in every answer (the
    client takes one per rank). ``max_chunks`` bounds a request (see the module
    docstring; ``for_rank`` derives it from the engine's config). The threads
    start at construction.
    """

    def __init__(self, engine: Engine, request_endpoint: str,
                 response_endpoint: str, curve: CurveKeys | None = None, *, rank: int,
                 max_chunks: int = DEFAULT_MAX_CHUNKS, max_blocks: int = 0) -> None:
        if rank < 0:
            raise ValueError(f"rank {rank}: must not be negative")
        if max_chunks <= 0:
            raise ValueError(f"max_chunks {max_chunks}: must be a positive integer")
        self.engine = engine
        self.rank = rank
        self.max_chunks = max_chunks
        self.max_request_bytes = max_request_bytes(max_chunks, max_blocks)
        self.max_queued_chunks = BULK_QUEUE_CHUNKS_FACTOR * max_chunks
        self.max_inflight_chunks = INFLIGHT_CHUNKS_FACTOR * max_chunks
        self.counters = ResponderCounters()
        for endpoint in (request_endpoint, response_endpoint):
            prepare_bind(endpoint)  # refuse a foreign runtime dir before opening anything
        self._context = zmq.Context()
        self._auth = CurveAuthenticator(self._context, curve) if curve is not None else None
        self._requests = pull_socket(self._context, request_endpoint,
                                     MESSAGE_LIMIT_FACTOR * self.max_request_bytes,
                                     curve=self._auth)
        self._responses = push_socket(self._context, response_endpoint, curve=curve)
        self.request_endpoint = last_endpoint(self._requests)
        self._registered = request_endpoint
        local.register(request_endpoint, self)  # a client of this process calls ``ask``
        self._send_lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        # The bulk lane and the in-flight budget (guarded by _lane).
        self._lane = threading.Condition()
        self._bulk: deque[_Queued] = deque()
        self._queued_ids: dict[str, list[_Queued]] = {}
        self._queued_chunks = 0
        self._inflight_chunks = 0
        self._waker = Waker(self._context)
        self._thread = threading.Thread(target=self._run, name="lmkv-lookup-responder",
                                        daemon=True)
        self._bulk_thread = threading.Thread(target=self._run_bulk,
                                             name="lmkv-lookup-responder-bulk", daemon=True)
        self._thread.start()
        self._bulk_thread.start()

    @classmethod
    def for_rank(cls, engine: Engine, endpoints: LookupEndpoints, rank: int,
                 *, max_tokens: int | None = None) -> LookupResponder:
        """The responder of ``rank``; requests are bounded by ``max_tokens`` (the
        model's maximum length when the caller knows it, else the config's
        ``lookup.max_tokens``) in the engine's chunks."""
        if not 0 <= rank < endpoints.world_size:
            raise ValueError(f"rank {rank}: the channel has ranks 0..{endpoints.world_size - 1}")
        config = engine.config
        tokens = max_tokens or config.lookup.max_tokens
        max_chunks = max_chunks_for(tokens, config.chunk_size)
        block = getattr(engine, "block_size", None)  # test doubles may lack it
        return cls(engine, endpoints.requests[rank], endpoints.responses, endpoints.curve,
                   rank=rank, max_chunks=max_chunks,
                   max_blocks=tokens // block if block else 0)

    # -- receiving -------------------------------------------------------------
    def _run(self) -> None:
        affinity.apply()
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
                _log.log(logging.ERROR, "recv", "lmkv lookup responder: receive failed: %s", exc)
            except Exception as exc:  # a bug; the thread must keep serving
                _unexpected(exc)

    def _handle(self, parts: list[bytes]) -> None:
        if len(parts) != 1:
            self._reject("multipart", "a %d-part message", len(parts))
            return
        data = parts[0]
        if len(data) > self.max_request_bytes:  # too long for max_chunks: never decoded
            head = decode_request_head(data)
            if head is None:
                self._reject("oversize", "a %d-byte message that is no request", len(data))
            else:
                self._refuse_oversize(head.lookup_id, head.token,
                                      f"a {len(data)}-byte message")
            return
        message = decode_message(data, "responder")
        if isinstance(message, LookupRequest):
            self._start(message)
        elif isinstance(message, LookupCleanup):
            self._cleanup(message.lookup_id)
        elif message is None:
            self.counters.rejected_messages += 1
        else:
            self._reject("unexpected", "a %s (workers take requests and cleanups)",
                         type(message).__name__)

    # -- requests from this process (``lmkv.lookup.local``) ----------------------
    def ask(self, request: LookupRequest, reply: Reply) -> None:
        """A request from a client in this process: served as one from the socket,
        its answer handed to ``reply`` (at once when the engine answers at once)."""
        if self._stop.is_set():
            reply(LookupResponse(request.lookup_id, 0, self.rank, request.token))
            return
        self._start(request, reply)

    def cleanup(self, lookup_id: str) -> None:
        """A cleanup from a client in this process."""
        if not self._stop.is_set():
            self._cleanup(lookup_id)

    def _reject(self, key: str, what: str, *args: object) -> None:
        self.counters.rejected_messages += 1
        _log.log(logging.ERROR, f"reject:{key}", "lmkv lookup responder: rejected " + what, *args)

    def _refuse_oversize(self, lookup_id: str, token: bytes, what: str,
                         reply: Reply | None = None) -> None:
        self.counters.requests += 1
        self.counters.oversize += 1
        _log.warning("oversize", "lmkv lookup %s: %s is over the limit of %d chunks "
                     "(lookup.max_tokens); answering a miss", lookup_id, what, self.max_chunks)
        self._answer(lookup_id, token, 0, reply)

    def _start(self, request: LookupRequest, reply: Reply | None = None) -> None:
        n = len(request.hashes)
        if n > self.max_chunks:
            self._refuse_oversize(request.lookup_id, request.token, f"a request of {n} chunks",
                                  reply)
            return
        self.counters.requests += 1
        if request.request_configs:
            logger.debug("lmkv lookup %s: ignoring request_configs %s", request.lookup_id,
                         sorted(request.request_configs))
        if n <= BULK_CHUNKS:
            self._prefetch(request, reply)
            return
        with self._lane:
            if self._queued_chunks + n > self.max_queued_chunks:
                shed = True
            else:
                shed = False
                entry = _Queued(request, reply)
                self._bulk.append(entry)
                self._queued_ids.setdefault(request.lookup_id, []).append(entry)
                self._queued_chunks += n
                self._lane.notify()
        if shed:
            self._shed(request, "the bulk lane is full", reply)

    def _cleanup(self, lookup_id: str) -> None:
        self.counters.cleanups += 1
        with self._lane:
            # A request still queued has not started: it must never start now,
            # or it would hold its prefetch with no cleanup to come.
            for entry in self._queued_ids.get(lookup_id, ()):
                entry.cancelled = True
        self.engine.release_lookup(lookup_id)

    def _shed(self, request: LookupRequest, why: str, reply: Reply | None) -> None:
        with self._lane:  # the receiving thread and the bulk lane both shed
            self.counters.shed += 1
        _log.warning("shed", "lmkv lookup %s: %s; answering a miss", request.lookup_id, why)
        self._answer(request.lookup_id, request.token, 0, reply)

    def _run_bulk(self) -> None:
        affinity.apply()
        while True:
            with self._lane:
                while not self._bulk and not self._stop.is_set():
                    self._lane.wait()
                if self._stop.is_set():
                    return
                entry = self._bulk.popleft()
                request = entry.request
                self._queued_chunks -= len(request.hashes)
                queued = self._queued_ids[request.lookup_id]
                queued.remove(entry)
                if not queued:
                    del self._queued_ids[request.lookup_id]
            if entry.cancelled:
                self.counters.dropped_queued += 1
                # every request: once
                self._answer(request.lookup_id, request.token, 0, entry.reply)
                continue
            try:
                self._prefetch(request, entry.reply)
            except Exception as exc:  # a bug; the lane must keep serving
                _unexpected(exc)

    def _prefetch(self, request: LookupRequest, reply: Reply | None = None) -> None:
        lookup_id, n = request.lookup_id, len(request.hashes)
        with self._lane:
            if self._inflight_chunks + n > self.max_inflight_chunks:
                over = True
            else:
                over = False
                self._inflight_chunks += n
        if over:
            self._shed(request, "too many chunks are being prefetched", reply)
            return
        try:
            blocks = (request.partials, request.block_tokens) if request.partials else ()
            future = self.engine.lookup_and_prefetch_hashes(lookup_id, request.hashes,
                                                            request.offsets, *blocks)
        except Exception as exc:  # the engine refused: answer a miss, keep serving
            _log.log(logging.ERROR, "engine", "lmkv lookup %s: prefetch failed: %s",
                     lookup_id, exc)
            self._prefetched(lookup_id, request.token, n, reply, None)
            return
        future.add_done_callback(partial(self._prefetched, lookup_id, request.token, n, reply))

    # -- answering -------------------------------------------------------------
    def _prefetched(self, lookup_id: str, token: bytes, chunks: int, reply: Reply | None,
                    future: Future | None) -> None:
        """Runs in the storage manager's prefetch thread (or at once when already done)."""
        with self._lane:
            self._inflight_chunks -= chunks
        hits = 0
        if future is not None:
            try:
                hits = int(future.result())
            except BaseException as exc:  # cancelled or failed: a miss
                _log.log(logging.ERROR, "result", "lmkv lookup %s: prefetch failed: %s",
                         lookup_id, exc)
        self._answer(lookup_id, token, max(hits, 0), reply)

    def _answer(self, lookup_id: str, token: bytes, hits: int,
                reply: Reply | None = None) -> None:
        if reply is not None:  # asked by a call: answered by one
            try:
                reply(LookupResponse(lookup_id, hits, self.rank, token))
            except Exception as exc:  # the client's bug: the responder keeps serving
                _unexpected(exc)
                return
            with self._send_lock:
                self.counters.answers += 1
            return
        answer = encode(LookupResponse(lookup_id, hits, self.rank, token))
        with self._send_lock:
            if self._closed:
                return
            try:
                self._responses.send(answer, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.counters.failed_sends += 1
                _log.log(logging.ERROR, "send",
                         "lmkv lookup responder: could not answer %s: %s", lookup_id, exc)
                return
            self.counters.answers += 1

    # -- the rest --------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters, and the work held now: requests queued in the bulk lane and
        chunks queued or being prefetched."""
        with self._lane:
            held = {"queued_requests": len(self._bulk), "queued_chunks": self._queued_chunks,
                    "inflight_chunks": self._inflight_chunks}
        return {**vars(self.counters), **held}

    def close(self) -> None:
        """Stop serving. Prefetched chunks stay with the engine (``engine.close`` frees them)."""
        if self._stop.is_set():
            return
        local.unregister(self._registered, self)
        self._stop.set()
        with self._lane:
            self._lane.notify_all()
        self._waker.wake()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._bulk_thread.join(CLOSE_TIMEOUT_S)
        with self._send_lock:
            self._closed = True
            if self._thread.is_alive():  # never close a socket a live thread uses
                logger.warning("lmkv lookup responder: receive thread did not stop; leaving it")
                return
            close_all([self._requests, self._responses])
        self._waker.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    def __enter__(self) -> LookupResponder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
