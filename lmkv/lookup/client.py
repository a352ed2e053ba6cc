"""Scheduler side of the lookup channel: hash once, ask every worker, keep the minimum.

``lookup(lookup_id, tokens)`` hashes the prompt (``lmkv.keys.chunking.prefix_hashes``
with the engine's chunk size), pushes one ``LookupRequest`` to every worker
and returns at once. A background thread collects the ``LookupResponse``
messages; the result is the MINIMUM over the workers (ranks may hold different
prefixes; the minimum is the prefix every rank can load).

``poll(lookup_id)``:

* ``-1``: no such lookup (never started, or forgotten: the client keeps the
  last ``results_kept`` results);
* ``None``: still pending, after waiting up to ``backoff_ms`` for the answer;
* the hit count in tokens when every worker has answered (a result of 0 also
  sends a cleanup: there is nothing to retrieve, and a worker that hit more
  than the minimum holds chunks);
* ``0`` once the lookup is past ``timeout_ms`` (it is then cancelled) or was
  cancelled; polling again keeps answering 0.

Answers are checked against the request they answer (a peer that reaches the
response socket must not be able to steer the scheduler): each request carries
a random token (``TOKEN_BYTES``, drawn per lookup) that only the workers it was
sent to receive, and an answer must carry it back; the lookup id must be
pending (or owe answers after a cancel), the rank in range and not yet heard
from, and the hit count 0 or one of the offsets sent (a chunk boundary, at most
the tokens looked up). Anything else is dropped and counted
(``invalid_answers``, ``unexpected_answers``); it never raises. Anyone who can
connect to the response socket can send answers, but without the token (which
travels on the connections to the workers only) none of them is taken.

A prompt of more chunks than ``max_chunks`` (the model's maximum length in
chunks; the workers refuse such requests too) answers 0 without asking.

Cancelled lookups: workers that already answered hold prefetched chunks, so
they get a ``LookupCleanup`` at once; every answer that arrives later for a
cancelled lookup sends another (cleanups are idempotent, and each one follows
its request on the same per-worker socket). Until every owed answer has
arrived (or ``STALE_ANSWER_TTL_S`` has passed) the id is not reused: a new
``lookup`` with that id answers 0, a cache miss, because an old answer could
not be told from a new one.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from pydantic import ValidationError

from lmkv.base import affinity
from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LMKVConfig, LookupConfig
from lmkv.engines.keys import hit_block_size
from lmkv.keys.chunking import DEFAULT_CHUNK_SIZE, Identity, KeyMeta, TokenChunker
from lmkv.lookup import local
from lmkv.lookup.messages import (
    TOKEN_BYTES,
    LookupCleanup,
    LookupRequest,
    LookupResponse,
    decode_message,
    encode,
    max_chunks_for,
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
from lmkv.rpc.auth import CurveAuthenticator

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

# The config's defaults, so a client built in code behaves like one from a config.
DEFAULT_TIMEOUT_MS = LookupConfig.model_fields["timeout_ms"].default
DEFAULT_BACKOFF_MS = LookupConfig.model_fields["backoff_ms"].default
DEFAULT_RESULTS_KEPT = 65536
STALE_ANSWER_TTL_S = 60.0
SWEEP_INTERVAL_MS = 100
CLOSE_TIMEOUT_S = 2.0
DEFAULT_MAX_TOKENS = LookupConfig.model_fields["max_tokens"].default
# A response is an id of at most 1024 characters, two integers and a token: a
# larger message is no answer, and ZMQ drops it (and its sender) unread.
MAX_RESPONSE_BYTES = 8 << 10
NO_TOKEN = "without the lookup's token (not from a worker the request was sent to)"


@dataclass
class _Pending:
    deadline: float
    token: bytes  # what its answers must carry
    offsets: list[int]  # what the request asked: valid hit counts are 0 and these
    block: int = 0  # with block-granular hits, also any whole block up to the last offset
    answered: int = 0  # bit r set: rank r has answered
    answers: int = 0
    hits: int = -1  # running minimum; -1 until the first answer


@dataclass
class _Owed:
    """A cancelled lookup some workers have not answered yet."""

    ranks: int  # bit r set: rank r still owes its answer
    expires: float
    token: bytes


@dataclass
class LookupClientCounters:
    lookups: int = 0
    completed: int = 0
    timeouts: int = 0
    cancels: int = 0
    cleanups_sent: int = 0
    late_answers: int = 0  # answers to cancelled lookups (each triggers a cleanup)
    unexpected_answers: int = 0  # answers to no known lookup
    invalid_answers: int = 0  # answers with a bad rank, a repeated rank or a bad count
    oversize: int = 0  # lookups over max_chunks, answered 0 without asking
    reused_while_owed: int = 0  # lookups answered 0 because their id still had answers owed
    failed_sends: int = 0
    rejected_messages: int = 0  # malformed, foreign or unexpected messages


class LookupClient:
    """The scheduler's end of the lookup channel. Thread-safe.

    Settings: ``chunk_size`` and ``save_partial_chunk`` must match the workers'
    engines (``from_config`` takes them from the config); ``timeout_ms``
    (default 3000) bounds a lookup; ``backoff_ms`` (default 10) is how long a
    poll of a pending lookup waits for its answer; ``results_kept`` finished
    results stay pollable; ``max_tokens`` (default 1,048,576; pass the model's
    maximum length) bounds a lookup, as it bounds the workers. ``local_calls``
    (default True): a worker whose responder runs in this process is called,
    not sent messages (``lmkv.lookup.local``).
    """

    def __init__(self, endpoints: LookupEndpoints, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 save_partial_chunk: bool = False, block_size: int | None = None,
                 timeout_ms: float = DEFAULT_TIMEOUT_MS,
                 backoff_ms: float = DEFAULT_BACKOFF_MS,
                 results_kept: int = DEFAULT_RESULTS_KEPT,
                 max_tokens: int = DEFAULT_MAX_TOKENS, local_calls: bool = True) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size {chunk_size}: must be a positive integer")
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms {timeout_ms}: must be positive")
        if backoff_ms < 0:
            raise ValueError(f"backoff_ms {backoff_ms}: must not be negative")
        if results_kept <= 0:
            raise ValueError(f"results_kept {results_kept}: must be a positive integer")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens {max_tokens}: must be a positive integer")
        self.endpoints = endpoints
        self.world_size = endpoints.world_size
        self.chunk_size = chunk_size
        self.save_partial_chunk = save_partial_chunk
        # Keys as the workers' engines make them (block-granular hits included).
        self._chunker = TokenChunker(KeyMeta(""), chunk_size, save_partial_chunk, block_size)
        self.block_size = self._chunker.block_size
        self.timeout_s = timeout_ms / 1000
        self.backoff_s = backoff_ms / 1000
        self.results_kept = results_kept
        self.max_chunks = max_chunks_for(max_tokens, chunk_size)
        self.local_calls = local_calls
        self.counters = LookupClientCounters()

        # Re-entrant: a worker of this process (``lmkv.lookup.local``) may answer
        # while the request is being sent, on the sending thread.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._pending: dict[str, _Pending] = {}
        self._results: OrderedDict[str, int] = OrderedDict()
        self._owed: dict[str, _Owed] = {}
        self._all_ranks = (1 << self.world_size) - 1
        self._closed = False

        for endpoint in (endpoints.responses, *endpoints.requests):
            prepare_bind(endpoint)  # refuse a foreign runtime dir before opening anything
        self._context = zmq.Context()
        self._auth = CurveAuthenticator(self._context, endpoints.curve) if endpoints.curve else None
        self._responses = pull_socket(self._context, endpoints.responses,
                                      MAX_RESPONSE_BYTES, curve=self._auth)
        self.response_endpoint = last_endpoint(self._responses)
        self._workers = [push_socket(self._context, e, curve=endpoints.curve)
                         for e in endpoints.requests]
        self._waker = Waker(self._context)
        self._thread = threading.Thread(target=self._run, name="lmkv-lookup-client",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: LMKVConfig, *, engine_id: str, world_size: int,
                    transport: str | None = None, runtime_dir: str | None = None,
                    host: str | None = None, base_port: int | None = None,
                    block_size: int | None = None, **settings: Any) -> LookupClient:
        """A client for the ``world_size`` workers of ``engine_id``, addressed by
        ``transport`` ("ipc" under ``runtime_dir``, or "tcp" on ``host`` from
        ``base_port``): see ``lmkv.lookup.sockets`` for the scheme. Arguments
        left out come from the config's ``lookup`` section (``max_tokens``: pass
        the model's maximum length when known). ``block_size``: the engine's
        block, as the workers' engines were given it (``hit_block_size``)."""
        given = {"transport": transport, "runtime_dir": runtime_dir, "host": host,
                 "base_port": base_port}
        try:  # the config's own rules (tcp needs base_port, ...) check the arguments
            lookup = LookupConfig.model_validate(
                {**dict(config.lookup), **{k: v for k, v in given.items() if v is not None}})
        except ValidationError as exc:
            raise ValueError("; ".join(
                ".".join(map(str, e["loc"])) + ": " * bool(e["loc"]) + e["msg"]
                for e in exc.errors())) from None
        settings.setdefault("timeout_ms", lookup.timeout_ms)
        settings.setdefault("backoff_ms", lookup.backoff_ms)
        settings.setdefault("max_tokens", lookup.max_tokens)
        endpoints = LookupEndpoints.from_config(lookup, engine_id, world_size)
        return cls(endpoints, chunk_size=config.chunk_size,
                   save_partial_chunk=config.save_partial_chunk,
                   block_size=hit_block_size(config, block_size), **settings)

    # -- the API ---------------------------------------------------------------
    def lookup(self, lookup_id: str, tokens: Sequence[int] | Any,
               identity: Identity | None = None) -> None:
        """Start looking up ``tokens`` (under ``identity``) on every worker; returns at
        once (see ``poll``). The chunk hashes carry the identity to the workers.

        A lookup already pending under ``lookup_id`` is left alone.
        """
        chunks = self._chunker.chunk(tokens, identity=identity)
        self.lookup_hashes(lookup_id, [k.chunk_hash for k in chunks.keys], chunks.ends,
                           partials=[[k.chunk_hash for k in ks] for ks in chunks.partials])

    def lookup_hashes(self, lookup_id: str, hashes: list[bytes], offsets: list[int],
                      request_configs: dict[str, Any] | None = None,
                      partials: list[list[bytes]] | None = None) -> None:
        """``lookup`` for chunk hashes already computed (``offsets``: cumulative ends;
        ``partials``: each chunk's leading blocks' hashes, blocks of ``block_size``)."""
        parts = partials if partials and self.block_size else []
        request = LookupRequest(lookup_id, hashes, offsets, request_configs or {},
                                parts, self.block_size if parts and self.block_size else 0,
                                os.urandom(TOKEN_BYTES))
        with self._lock:
            if self._closed:
                raise RuntimeError("the lookup client is closed")
            if lookup_id in self._pending:
                return
            self.counters.lookups += 1
            if not hashes:  # shorter than a chunk: nothing any worker could hold
                self._finish(lookup_id, 0)
                return
            if len(hashes) > self.max_chunks:  # every worker would refuse it
                self.counters.oversize += 1
                _log.warning("oversize", "lmkv lookup %s: %d chunks is over the limit of %d "
                             "(lookup.max_tokens); answering a miss", lookup_id, len(hashes),
                             self.max_chunks)
                self._finish(lookup_id, 0)
                return
            if lookup_id in self._owed:
                self.counters.reused_while_owed += 1
                _log.warning("reused", "lmkv lookup %s: the id's previous (cancelled) lookup "
                             "still has answers owed; answering a miss", lookup_id)
                self._finish(lookup_id, 0)
                return
            self._results.pop(lookup_id, None)
            pending = _Pending(time.monotonic() + self.timeout_s, request.token,
                               request.offsets, request.block_tokens)
            self._pending[lookup_id] = pending
            sent = self._send_locked(request, lookup_id)
            if sent != self._all_ranks:  # a worker cannot answer: the lookup is a miss
                self._pending.pop(lookup_id, None)
                self._finish(lookup_id, 0)
                if sent:  # the others release what they prefetch, then owe an answer
                    self._cleanup_locked(lookup_id)
                    owed = sent & ~pending.answered  # (a worker of this process answered)
                    if owed:
                        self._owed[lookup_id] = _Owed(owed,
                                                      pending.deadline + STALE_ANSWER_TTL_S,
                                                      pending.token)

    def poll(self, lookup_id: str, wait_s: float | None = None) -> int | None:
        """-1 unknown, None pending (after waiting up to ``wait_s``, default
        ``backoff_ms``, for the answer), else the hit tokens."""
        with self._lock:
            wake_at = time.monotonic() + (self.backoff_s if wait_s is None else max(wait_s, 0))
            while True:
                result = self._results.get(lookup_id)
                if result is not None:
                    return result
                pending = self._pending.get(lookup_id)
                if pending is None:
                    return -1
                now = time.monotonic()
                if now >= pending.deadline:
                    self.counters.timeouts += 1
                    _log.warning("timeout", "lmkv lookup %s: no answer from every worker in "
                                 "%.0f ms; answering a miss", lookup_id, self.timeout_s * 1e3)
                    self._cancel_locked(lookup_id)
                    return 0
                wait = min(wake_at, pending.deadline) - now
                if wait <= 0:
                    return None
                self._cond.wait(wait)

    def cancel(self, lookup_id: str) -> None:
        """Give up on a lookup (polling then answers 0) and have the workers release
        what it prefetched. Also releases a finished lookup that will not be retrieved.
        Unknown ids are ignored."""
        with self._lock:
            if self._closed:
                return
            if lookup_id in self._pending:
                self._cancel_locked(lookup_id)
            elif lookup_id in self._results and lookup_id not in self._owed:
                self.counters.cancels += 1
                self._results[lookup_id] = 0
                self._cleanup_locked(lookup_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**vars(self.counters), "pending": len(self._pending),
                    "owed": len(self._owed)}

    def close(self) -> None:
        """Stop at once: pending lookups answer 0; nothing more is sent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for lookup_id in list(self._pending):
                del self._pending[lookup_id]
                self._results[lookup_id] = 0
            self._cond.notify_all()
        self._waker.wake()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # never close sockets a live thread uses
            logger.warning("lmkv lookup client: receive thread did not stop; leaving it")
            return
        with self._lock:
            close_all([self._responses, *self._workers])
        self._waker.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state changes (the lock is held) --------------------------------------
    def _finish(self, lookup_id: str, hits: int) -> None:
        self._results[lookup_id] = hits
        self._results.move_to_end(lookup_id)
        while len(self._results) > self.results_kept:
            self._results.popitem(last=False)
        self._cond.notify_all()

    def _cancel_locked(self, lookup_id: str) -> None:
        pending = self._pending.pop(lookup_id)
        self.counters.cancels += 1
        self._finish(lookup_id, 0)
        if pending.answers:  # those workers hold what they prefetched
            self._cleanup_locked(lookup_id)
        owed = self._all_ranks & ~pending.answered
        if owed:
            self._owed[lookup_id] = _Owed(owed, time.monotonic() + STALE_ANSWER_TTL_S,
                                          pending.token)

    def _cleanup_locked(self, lookup_id: str) -> None:
        self._send_locked(LookupCleanup(lookup_id), lookup_id)
        self.counters.cleanups_sent += 1

    def _send_locked(self, message: LookupRequest | LookupCleanup, lookup_id: str) -> int:
        """Send ``message`` to every worker; returns the ranks that took it (bit r: rank r).

        A worker whose responder runs in this process is called instead: a
        request's answer may then come back before this returns."""
        sent = 0
        encoded: bytes | None = None
        for rank, sock in enumerate(self._workers):
            responder = local.find(self.endpoints.requests[rank]) if self.local_calls else None
            if responder is not None:
                try:
                    if isinstance(message, LookupRequest):
                        responder.ask(message, self._answered)
                    else:
                        responder.cleanup(lookup_id)
                except Exception as exc:  # a bug: as a worker that cannot be reached
                    self.counters.failed_sends += 1
                    _log.log(logging.ERROR, f"local:{rank}", "lmkv lookup %s: worker %d of "
                             "this process failed: %r", lookup_id, rank, exc)
                    continue
                sent |= 1 << rank
                continue
            if encoded is None:
                encoded = encode(message)
            try:
                sock.send(encoded, zmq.NOBLOCK)
                sent |= 1 << rank
            except zmq.ZMQError as exc:  # Again: the worker's queue is full (stalled worker)
                self.counters.failed_sends += 1
                _log.warning(f"send:{rank}", "lmkv lookup %s: could not send to worker %d "
                             "(%s): %s", lookup_id, rank, self.endpoints.requests[rank], exc)
        return sent

    def _answered(self, response: LookupResponse) -> None:
        lookup_id, rank, hits = response.lookup_id, response.rank, response.num_hit_tokens
        with self._lock:
            pending = self._pending.get(lookup_id)
            if pending is not None:
                problem = self._check_answer(pending, response)
                if problem:
                    self._invalid_locked(lookup_id, rank, hits, problem)
                    return
                pending.answered |= 1 << rank
                pending.answers += 1
                if pending.hits < 0 or hits < pending.hits:
                    pending.hits = hits
                if pending.answers >= self.world_size:
                    del self._pending[lookup_id]
                    self.counters.completed += 1
                    self._finish(lookup_id, pending.hits)
                    if pending.hits == 0:  # nothing to retrieve: the workers drop the lookup
                        self._cleanup_locked(lookup_id)
                return
            owed = self._owed.get(lookup_id)
            if owed is not None:
                if not hmac.compare_digest(response.token, owed.token):
                    self._invalid_locked(lookup_id, rank, hits, NO_TOKEN)
                    return
                if rank >= self.world_size or not owed.ranks >> rank & 1:
                    self._invalid_locked(lookup_id, rank, hits, "from a rank that owes none")
                    return
                self.counters.late_answers += 1
                self._cleanup_locked(lookup_id)
                owed.ranks &= ~(1 << rank)
                if not owed.ranks:
                    del self._owed[lookup_id]
                return
            self.counters.unexpected_answers += 1
        _log.warning("unexpected", "lmkv lookup %s: dropped an answer (rank %d) for no "
                     "lookup this client has pending", lookup_id, rank)

    def _check_answer(self, pending: _Pending, response: LookupResponse) -> str | None:
        """Why ``response`` cannot be its rank's answer to ``pending`` (None: it can)."""
        rank, hits = response.rank, response.num_hit_tokens
        if not hmac.compare_digest(response.token, pending.token):
            return NO_TOKEN
        if rank >= self.world_size:
            return f"rank out of range (the channel has ranks 0..{self.world_size - 1})"
        if pending.answered >> rank & 1:
            return "a second answer from the rank"
        if hits:
            offsets = pending.offsets
            i = bisect_left(offsets, hits)
            if pending.block and hits <= offsets[-1] and hits % pending.block == 0:
                return None
            if i == len(offsets) or offsets[i] != hits:
                return (f"not a chunk boundary of the request (0 or one of its offsets, "
                        f"at most {offsets[-1]})")
        return None

    def _invalid_locked(self, lookup_id: str, rank: int, hits: int, problem: str) -> None:
        self.counters.invalid_answers += 1
        _log.warning("invalid", "lmkv lookup %s: dropped an answer of %d tokens from rank %d: "
                     "%s", lookup_id, hits, rank, problem)

    def _sweep(self) -> None:
        """Cancel lookups past their deadline that nobody polls; forget stale debts."""
        now = time.monotonic()
        with self._lock:
            for lookup_id in [i for i, p in self._pending.items() if p.deadline <= now]:
                self.counters.timeouts += 1
                self._cancel_locked(lookup_id)
            for lookup_id in [i for i, o in self._owed.items() if o.expires <= now]:
                # A worker went silent. It may still come back: its cleanup waits
                # behind its request in its queue.
                del self._owed[lookup_id]
                self._cleanup_locked(lookup_id)

    # -- the receiving thread --------------------------------------------------
    def _run(self) -> None:
        affinity.apply()
        sock = self._responses
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.socket, zmq.POLLIN)
        next_sweep = time.monotonic()
        while not self._closed:
            try:
                ready = dict(poller.poll(SWEEP_INTERVAL_MS))
                if sock in ready:
                    self._drain(sock)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_INTERVAL_MS / 1000
                    self._sweep()
            except zmq.ZMQError as exc:
                if self._closed:
                    break
                _log.log(logging.ERROR, "recv", "lmkv lookup client: receive failed: %s", exc)
            except Exception as exc:  # a bug; the thread must keep collecting answers
                _log.log(logging.ERROR, "unexpected", "lmkv lookup client: unexpected error "
                         "in the receive thread: %s: %s", type(exc).__name__, exc)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = decode_message(parts[0], "client") if len(parts) == 1 else None
            if isinstance(message, LookupResponse):
                self._answered(message)
                continue
            self.counters.rejected_messages += 1
            if message is not None or len(parts) != 1:
                _log.log(logging.ERROR, "reject", "lmkv lookup client: rejected a %s",
                         type(message).__name__ if message else f"{len(parts)}-part message")
