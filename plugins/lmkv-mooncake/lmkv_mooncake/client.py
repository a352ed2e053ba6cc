"""The mooncake tier's link to the store: the client library, its return codes
and the tier's breaker around every call.

Mooncake's Python client reports faults as negative return codes, not
exceptions; ``raise_for`` turns a code into ``MooncakeError`` (absorbed: a
miss or a dropped write) or ``MasterUnreachable`` (the master or the
transfer path is gone: it opens the breaker, so a dead master costs one
failed call per backoff interval, not one per engine step).

The store is set up on a background thread: the tier waits ``connect_timeout_s``
for it at start, then answers misses until it is up, never a failed start and
never an engine thread held. Mooncake's ``setup`` holds the GIL in native code
and, against a master that does not answer, retries for about 90 s (every
Python thread of the process stalls, signal handlers included) while logging
a dozen lines a try: so ``setup`` is called only once the addresses it needs
accept a TCP connection (``silent_peer``), and its own retries are cut to one
(``MC_STORE_CLIENT_SETUP_RETRIES``). Mooncake's client re-registers its
segment with a restarted master by itself; nothing here has to reconnect.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

import torch

from lmkv.contracts import (
    BreakerOpen,
    MemoryAllocator,
    PluginError,
    TierFaults,
    TierUnavailable,
    apply_affinity,
)
from lmkv_mooncake.memory import Registered
from lmkv_mooncake.options import MooncakeOptions

logger = logging.getLogger(__name__)

PACKAGES = ("mooncake-transfer-engine-non-cuda (CPU hosts: pip install 'lmkv-mooncake[cpu]') "
            "or mooncake-transfer-engine (GPU hosts: pip install 'lmkv-mooncake[gpu]')")

#: Mooncake's error codes (mooncake-store types.h) that the tier tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
REPLICA_IS_NOT_READY = -703  # an entry still being written (its put not ended)
#: What a get or size answers for a key with no readable entry, none or one
#: still being written: a miss, refused before any transfer.
NOT_THERE = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})
INVALID_WRITE = -700  # what revoking an entry the master already holds whole answers
TRANSFER_FAIL = -800  # also what a get of a smaller object into larger buffers answers
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: what a get into a too small buffer answers
CODE_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -900: "RPC_FAIL",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
#: Codes that say the master (or the path to a segment) is gone, not one entry
#: (with every code from -900 to -999: the RPC layer's).
UNREACHABLE_CODES = frozenset({-800, -900, -1010})


def unreachable(code: int) -> bool:
    """Whether ``code`` says the master or the path to a segment is gone."""
    return code in UNREACHABLE_CODES or -999 <= code <= -900


#: How long ``Link.close`` waits for calls in progress.
CLOSE_WAIT_S = 10.0


class MooncakeMissing(PluginError, ImportError):
    """Neither Mooncake client package is installed (an LMKVError: the CLI
    prints it as one line)."""


class MixedClients(PluginError, ValueError):
    """A tier asked for the other kind of Mooncake client than this process has."""


class MooncakeError(OSError):
    """A Mooncake call failed for this request (absorbed: a miss or a dropped write)."""

    def __init__(self, op: str, code: int, what: str | None = None) -> None:
        super().__init__(what or f"{op} answered {code} ({CODE_NAMES.get(code, 'error')})")
        self.code = code


class MasterUnreachable(TierUnavailable):
    """The master or the transfer path cannot be reached: opens the breaker."""


class NotConnected(BreakerOpen):
    """The store is not set up yet: a miss, not attempted (so not an error)."""


class TierClosed(ConnectionError):
    """The tier is closed: no store any more (absorbed like any connection fault)."""


#: Mooncake's environment, unless the user set it: one try per ``setup`` (the
#: tier retries with its own backoff, off the GIL), and its log at WARNING.
MOONCAKE_ENV_DEFAULTS = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "WARNING"}


def store_class() -> type:
    """``MooncakeDistributedStore``; ``MooncakeMissing`` (one line naming both
    packages) when neither build of the client is installed."""
    for name, value in MOONCAKE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)  # read by the client library: before it loads
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeMissing(f"the mooncake tier needs the Mooncake client: install "
                              f"{PACKAGES} ({exc})") from None
    return MooncakeDistributedStore


def raise_for(op: str, code: int) -> None:
    """Raise for a negative Mooncake return code (no-op for a success)."""
    if code >= 0:
        return
    if unreachable(code):  # RPC_FAIL, RPC timeouts
        raise MasterUnreachable(f"{op} answered {code} ({CODE_NAMES.get(code, 'RPC error')})")
    raise MooncakeError(op, code)


def replicate_config(options: MooncakeOptions) -> Any:
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = options.replica_num
    return config


#: How long a probe of one address waits for a TCP connection.
PROBE_TIMEOUT_S = 1.0


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _endpoints(url: str) -> list[str]:
    """The ``host:port`` addresses of ``host:port``, ``etcd://a:1;b:2`` or an
    ``http(s)://`` URL (default port 80 or 443), without credentials."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return [url]
    hosts = rest.split("/", 1)[0].rpartition("@")[2]
    default = {"http": "80", "https": "443"}.get(scheme, "")
    return [h if h.rpartition(":")[2].isdigit() or not default else f"{h}:{default}"
            for h in hosts.replace(",", ";").split(";") if h]


def silent_peer(options: MooncakeOptions, redact: Callable[[object], str] = str) -> str:
    """What ``setup`` would need that accepts no TCP connection now ("master
    127.0.0.1:50051", ...), or "" when every address answers (for etcd, any
    one of its endpoints)."""
    if options.client_address:
        peers = [("the mooncake_client at", [options.client_address])]
    else:
        peers = [("master", _endpoints(options.master_address))]
        if options.metadata_server != "P2PHANDSHAKE":
            peers.append(("metadata server", _endpoints(options.metadata_server)))
    for what, addresses in peers:
        if not any(answers(a) for a in addresses):
            return f"{what} {redact(';'.join(addresses))}"
    return ""


def _client_of(options: MooncakeOptions) -> tuple:
    """What makes two tiers' clients the same client: the connection, the segment."""
    if options.client_address:
        return ("real-client", options.client_address, int(options.local_buffer_size))
    return (options.master_address, options.metadata_server, options.local_hostname,
            options.protocol, options.device_name, int(options.global_segment_size),
            int(options.local_buffer_size))


class _Client:
    """One Mooncake client (one store, one segment) shared by every tier of this
    process with the same connection options: Mooncake wants one per process,
    and a second would mount a second segment and pay a second setup."""

    def __init__(self, options: MooncakeOptions, cls: type, faults: TierFaults) -> None:
        self.options = options
        self.faults = faults  # the first tier's: setup retries are noted there
        self.users = 0
        self.store: Any = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Condition()
        self.busy = 0  # calls in progress
        self.closed = False
        self.registered = Registered()  # memory registered with this store
        # With a real client: the staging every tier of this client shares, in
        # shared memory this process makes and hands to the real client (set up
        # with the store).
        self.shared_staging: MemoryAllocator | None = None
        # Buffers a failed transfer may still write into (see ``Link.quarantine``).
        self.quarantined: list[Any] = []
        self.sessions: set[str] = set()  # keys with a get session open (``claim_sessions``)
        # Keys whose put session this process may hold (``claim_puts``): a put's
        # in progress, or (``unsettled``) one a call left open in Mooncake.
        self.puts: set[str] = set()
        self.unsettled: dict[str, bool] = {}  # name -> its end may have been sent
        # What setup waits for while it does not answer (the start-up line says it).
        self.silent = ""
        self._cls = cls
        threading.Thread(target=self._connect, name="lmkv-mooncake-setup", daemon=True).start()

    def _connect(self) -> None:
        # The store's own threads (transfers, polling) start here and inherit this
        # thread's CPUs: the engine's, not the one its main thread is bound to.
        apply_affinity()
        o = self.options
        backoff = o.retry_after_s
        while not self.stop.is_set():
            # Asked first, off the GIL: setup against a silent master stalls the process.
            self.silent = silent_peer(o, self.faults.redact)
            if self.silent:
                logger.debug("lmkv mooncake tier: %s does not answer; asking again in %.1fs",
                             self.silent, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 4 * o.retry_after_s)
                continue
            store = self._cls()
            code = self._setup(store)
            if code == 0:
                with self.lock:
                    if self.closed:  # closed while setting up: undo it here
                        store.close()
                        return
                    self.store = store
                    self.ready.set()
                if o.client_address:
                    logger.info("lmkv mooncake tier: connected to the mooncake_client at %s",
                                o.client_address)
                else:
                    logger.info("lmkv mooncake tier: connected to master %s (%s, segment of "
                                "%d bytes)", self.faults.redact(o.master_address), o.protocol,
                                int(o.global_segment_size))
                return
            store.close()
            peer = (f"the mooncake_client at {o.client_address}" if o.client_address
                    else f"master {self.faults.redact(o.master_address)}")
            self.faults.note("setup", "setting up with %s answered %d; retrying in %.1fs",
                             peer, code, backoff)
            self.stop.wait(backoff)
            backoff = min(backoff * 2, 4 * o.retry_after_s)

    def _setup(self, store: Any) -> int:
        """Set ``store`` up: embedded (its own transfer engine, segment and local
        buffer, where ``batch_get_buffer`` lands frames) or, with
        ``client_address``, as a thin client of the host's real client, with
        the staging its tiers share allocated from the shared memory pool it
        hands the real client."""
        o = self.options
        size = int(o.local_buffer_size)
        if not o.client_address:
            return store.setup(o.local_hostname, o.metadata_server, int(o.global_segment_size),
                               size, o.protocol, o.device_name, o.master_address)
        code = store.setup_dummy(size, size, o.client_address)
        if code != 0:
            return code
        ptr = store.alloc_from_mem_pool(size)
        if not ptr or not self.registered.register(store, ptr, size):
            logger.warning("lmkv mooncake tier: the mooncake_client at %s gave no shared "
                           "staging of %d bytes", o.client_address, size)
            return -1
        self.shared_staging = MemoryAllocator(size, pin_memory=False, buffer=torch.frombuffer(
            (ctypes.c_ubyte * size).from_address(ptr), dtype=torch.uint8))
        return 0

    def close(self) -> None:
        """Unmount the segment and disconnect, once calls in progress end (they
        get CLOSE_WAIT_S; past it the store is left open, the master unmounts it
        when its heartbeats stop, rather than freed under them)."""
        try:
            with self.lock:
                self.closed = True
                self.stop.set()
                if not self.lock.wait_for(lambda: self.busy == 0, CLOSE_WAIT_S):
                    logger.warning("lmkv mooncake tier: calls still in progress after %.0fs; "
                                   "leaving the store to the master's client timeout",
                                   CLOSE_WAIT_S)
                    return
                store, self.store = self.store, None
            if store is not None:
                store.close()  # holds the GIL for a second or two (Mooncake 0.3.13)
            # The transfer engine is gone: nothing writes into quarantined buffers now.
            with self.lock:
                quarantined, self.quarantined = self.quarantined, []
            for obj in quarantined:
                obj.ref_down()
        except Exception:  # closing must never raise into shutdown
            logger.exception("lmkv mooncake tier: closing the store failed")
        finally:
            with _CLOSING_LOCK:
                _CLOSING.discard(threading.current_thread())


class _Helpers:
    """Daemon threads that run store calls for ``Link.call`` (a hung call must
    not hold interpreter exit, as an executor's threads would): one more is
    started when none is idle, and one idle for a minute ends."""

    IDLE_S = 60.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, result: Future, fn: Callable[..., Any], args: tuple,
            finished: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # this job is that thread's
        self._jobs.put((result, fn, args, finished))
        if start:
            threading.Thread(target=self._work, name="lmkv-mooncake-call", daemon=True).start()

    def _work(self) -> None:
        apply_affinity()
        while True:
            try:
                result, fn, args, finished = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:
                        self._idle -= 1
                        return
                continue  # a job is on its way to this thread
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller
                result.set_exception(exc)
            finally:
                finished()
            with self._lock:
                self._idle += 1


_HELPERS = _Helpers()

_CLIENTS: dict[tuple, _Client] = {}
_CLIENTS_LOCK = threading.Lock()
#: The kind of Mooncake client this process made first, for its whole life:
#: "thin" (``setup_dummy``) or "embedded" (``setup``). Mooncake 0.3.13 aborts or
#: crashes in its RPC code when both kinds are used in one process (seen in this
#: plugin's tests, 2 runs in 3), even after the other kind was closed.
_KIND: str | None = None


class Link:
    """One tier's handle on its process's shared client, and the tier's breaker
    in front of it."""

    def __init__(self, options: MooncakeOptions, faults: TierFaults,
                 on_setup: Callable[[Any], None] | None = None) -> None:
        self.options = options
        self.faults = faults
        cls = store_class()  # fail at start, in one line, without the package
        self._on_setup = on_setup
        self._set_up = False
        self.closed = False
        global _KIND
        kind = "thin" if options.client_address else "embedded"
        with _CLIENTS_LOCK:
            if _KIND not in (None, kind):
                raise MixedClients(
                    "this process already made a Mooncake client of the other kind: thin "
                    "clients of a mooncake_client (client_address set) and embedded clients "
                    "(client_address empty) cannot share a process (Mooncake 0.3.13 aborts); "
                    "give every mooncake tier of a process client_address, or none")
            _KIND = kind
            client = _CLIENTS.get(_client_of(options))
            if client is None or client.closed:
                if options.client_address:
                    # Another real client's idle thin client goes first: with two
                    # set up, Mooncake 0.3.13's re-registration after a real client
                    # restarts left this one's shared memory unknown to it.
                    _close_idle_thin_clients()
                client = _CLIENTS[_client_of(options)] = _Client(options, cls, faults)
            client.users += 1
        self._client = client
        self.registered = client.registered

    def call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a call into the store, given ``call_timeout_s``: past it,
        ``MasterUnreachable`` (the breaker opens). Mooncake cannot cancel a call,
        so it runs on a helper thread and counts as a call in progress until it
        returns (closing never frees the store under it)."""
        if not self.options.call_timeout_s:
            return fn(*args)
        return self.start(op, fn, *args)()

    def start(self, op: str, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """``fn(*args)`` begun on a helper thread (Mooncake's calls let go of the
        GIL: the caller works meanwhile); the ``wait()`` returned answers as
        ``call`` does, ``call_timeout_s`` counted from now."""
        client = self._client
        with client.lock:
            client.busy += 1

        def finished() -> None:
            with client.lock:
                client.busy -= 1
                client.lock.notify_all()

        result: Future = Future()
        _HELPERS.run(result, fn, args, finished)
        timeout = self.options.call_timeout_s
        deadline = time.monotonic() + timeout

        def wait() -> Any:
            try:
                return result.result(max(0.0, deadline - time.monotonic()) if timeout else None)
            except FutureTimeout:
                raise MasterUnreachable(f"{op} did not answer in {timeout:g}s "
                                        "(call_timeout_s)") from None
        return wait

    def claim_sessions(self, names: Sequence[str]) -> bool:
        """Whether this thread may open get sessions on ``names``: Mooncake keeps
        one session per key and client, so a second get of a key while one is
        open would end the first's (its ranged reads would then fail). False when
        another get holds one of them; ``release_sessions`` gives them back."""
        wanted = set(names)
        with self._client.lock:
            if wanted & self._client.sessions:
                return False
            self._client.sessions |= wanted
            return True

    def release_sessions(self, names: Sequence[str]) -> None:
        with self._client.lock:
            self._client.sessions -= set(names)

    def claim_puts(self, names: Sequence[str]) -> set[str]:
        """The ``names`` this thread may open put sessions on: Mooncake keeps one
        put session per key and client, so a writer must not start, end or revoke
        one another writer of this process holds, nor one a failed call left
        open (``take_unsettled`` hands those out). ``release_puts`` gives them
        back."""
        with self._client.lock:
            mine = set(names) - self._client.puts
            self._client.puts |= mine
            return mine

    def release_puts(self, names: Iterable[str],
                     unsettled: Mapping[str, bool] | None = None) -> None:
        """Give back claimed ``names``; those in ``unsettled`` (a put session
        Mooncake may still hold, each with whether its end may have reached the
        master) stay claimed until a writer settles them."""
        left = dict(unsettled or {})
        with self._client.lock:
            self._client.puts -= set(names) - left.keys()
            for name, end_sent in left.items():
                self._client.unsettled[name] = end_sent or \
                    self._client.unsettled.get(name, False)

    def take_unsettled(self) -> dict[str, bool]:
        """Claim every key whose put session a failed call left open (to revoke
        it), with whether its end may have reached the master; ``release_puts``
        gives them back."""
        with self._client.lock:
            names, self._client.unsettled = self._client.unsettled, {}
            return names

    def quarantine(self, objs: list[Any]) -> None:
        """Keep ``objs`` (MemoryObjs the store was asked to write into by a call
        that failed) out of their allocator: Mooncake 0.3.13 gives no way to
        cancel or wait for a transfer, so after a failed call one may still be
        writing into them, and a block reused by another chunk would be
        overwritten (wrong KV). They are freed once this process's store is
        closed, never when it was left open (calls still in progress)."""
        with self._client.lock:
            self._client.quarantined.extend(objs)

    @property
    def registers_arena(self) -> bool:
        """Whether chunks' own arenas are registered with the store (a real
        client reaches only the memory it maps: never then)."""
        return self.options.register_arena and not self.options.client_address

    @property
    def shared_staging(self) -> MemoryAllocator | None:
        """With a real client, the staging its tiers share (once set up)."""
        return self._client.shared_staging

    def wait_ready(self, timeout_s: float) -> bool:
        return self._client.ready.wait(timeout_s)

    @property
    def silent(self) -> str:
        """What the store's setup is waiting for to answer ("" when nothing)."""
        return self._client.silent

    @property
    def usable(self) -> bool:
        """False when closed, not set up yet or while the breaker is open."""
        return (self._client.ready.is_set() and not self.closed
                and not self.faults.breaker.is_open)

    @contextmanager
    def using(self, breaker: bool = True) -> Iterator[Any]:
        """The set-up store, for the block's calls; ``BreakerOpen`` while the
        breaker is open (unless ``breaker`` is False: a tier closing gives its
        registrations back whatever the breaker says) or the store is not set up
        yet, ``TierClosed`` once closed. Closing waits for the blocks in progress
        before it frees the store (a call into a closed store would touch freed
        memory)."""
        client = self._client
        with client.lock:
            if self.closed or client.closed:
                raise TierClosed("the mooncake tier is closed")
            if not client.ready.is_set():
                peer = (f"the mooncake_client at {self.options.client_address}"
                        if self.options.client_address
                        else f"master {self.faults.redact(self.options.master_address)}")
                raise NotConnected(f"not connected to {peer} yet")
            if breaker:
                self.faults.check()
            client.busy += 1
            if not self._set_up:
                self._set_up = True
                if self._on_setup is not None:
                    self._on_setup(client.store)
        try:
            yield client.store
        finally:
            with client.lock:
                client.busy -= 1
                client.lock.notify_all()

    def close(self) -> None:
        """Leave the shared client; the last tier to leave starts unmounting the
        segment and disconnecting, and returns (``join_closing`` waits for it,
        and runs at interpreter exit). Idempotent."""
        client = self._client
        with _CLIENTS_LOCK:
            if self.closed:
                return
            self.closed = True
            client.users -= 1
            if client.users:
                return
            if self.options.client_address and client.ready.is_set():
                # Kept for the process's life and reused by the next tier of this
                # client: Mooncake 0.3.13's close frees neither the memory pool the
                # staging came from nor its registration, so a thin client closed
                # and made again would leak a staging per tier (closed at exit).
                return
            if _CLIENTS.get(_client_of(self.options)) is client:
                del _CLIENTS[_client_of(self.options)]
        _start_closing(client)


_CLOSING: set[threading.Thread] = set()
_CLOSING_LOCK = threading.Lock()


def join_closing(timeout_s: float = CLOSE_WAIT_S + 5) -> bool:
    """Wait for the stores being closed (segments unmounted); False past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _CLOSING_LOCK:
            threads = list(_CLOSING)
        if not threads:
            return True
        threads[0].join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            return False


atexit.register(join_closing)


def _start_closing(client: _Client) -> None:
    """Close ``client`` on a thread of its own (``join_closing`` waits for it)."""
    thread = threading.Thread(target=client.close, name="lmkv-mooncake-close", daemon=True)
    with _CLOSING_LOCK:
        _CLOSING.add(thread)
    thread.start()


def _close_idle_thin_clients() -> None:
    """Start closing the thin clients no tier uses (``_CLIENTS_LOCK`` held)."""
    for key in [k for k, c in _CLIENTS.items() if c.users == 0 and not c.closed]:
        _start_closing(_CLIENTS.pop(key))


def _close_kept_clients() -> None:
    """At exit (before ``join_closing`` waits): close the thin clients no tier
    uses any more."""
    with _CLIENTS_LOCK:
        _close_idle_thin_clients()


atexit.register(_close_kept_clients)  # runs before join_closing (atexit is last in, first out)
