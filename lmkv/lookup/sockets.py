"""Where the lookup channel's sockets live, and how they are opened.

Addressing (one engine = one scheduler process + ``world_size`` workers):

* each worker **binds** a PULL socket for requests; the scheduler's client
  connects one PUSH socket to each of them (one per worker, never a shared
  round-robin PUSH: a cleanup must reach every worker, after its request);
* the client **binds** one PULL socket for responses; every worker connects a
  PUSH socket to it.

``ipc`` (the default) derives the paths from a runtime directory::

    ipc://{runtime_dir}/lmkv-lookup-{engine_id}-{rank}.sock       requests, rank 0..N-1
    ipc://{runtime_dir}/lmkv-lookup-{engine_id}-responses.sock    responses

``tcp`` uses consecutive ports on one host: ``tcp://{host}:{base_port + rank}``
for requests and ``tcp://{host}:{base_port + world_size}`` for responses.
Endpoints may also be given explicitly (``LookupEndpoints(requests=...,
responses=...)``), e.g. for workers on other hosts.

``engine_id`` must be unique per runtime directory: binding an ipc path
replaces a socket file left there, including a live engine's.

With ``lookup.curve`` (a key pair the scheduler and its workers share; meant
for ``tcp``), every socket speaks ZMQ CURVE: bound sockets accept only the
authorized keys, connecting ones check the peer's key (docs/security.md).

Closed by default: the runtime directory is created owner-only (0700); an
existing one is used only when it is a real directory owned by this user and
not writable by group or others (``ensure_private_dir``), so another local
user cannot pre-create the predictable path and bind the sockets first.
Socket files are made owner-only (0600). tcp binds loopback by default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from lmkv.base.errors import ConfigError
from lmkv.base.private import default_runtime_dir, make_private_dir
from lmkv.config.model import LookupConfig, is_loopback_host
from lmkv.rpc.auth import CurveAuthenticator, CurveKeys, peer_keys, secure_client

# sockaddr_un.sun_path holds 108 bytes on Linux (104 on macOS), NUL included.
logger = logging.getLogger(__name__)

MAX_IPC_PATH_BYTES = 103
_ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Queued messages per peer before a send would block; a send that would block fails instead.
SEND_HWM = 100_000
# A larger message disconnects its sender (ZMQ MAXMSGSIZE); responders and clients
# pass a tighter bound derived from what they accept (see responder.py, client.py).
MAX_MESSAGE_BYTES = 64 << 20
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 1000


@dataclass(frozen=True)
class LookupEndpoints:
    """The request endpoint of every worker (by rank) and the client's response endpoint."""

    requests: tuple[str, ...]
    responses: str
    # The channel's CURVE keys; None: plain ZMQ.
    curve: CurveKeys | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("the lookup channel needs at least one worker endpoint")
        for endpoint in (*self.requests, self.responses):
            check_endpoint(endpoint)

    @property
    def world_size(self) -> int:
        return len(self.requests)

    @classmethod
    def ipc(cls, engine_id: str, world_size: int,
            runtime_dir: str | os.PathLike | None = None) -> LookupEndpoints:
        _check_layout(engine_id, world_size)
        base = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        prefix = f"ipc://{base.absolute()}/lmkv-lookup-{engine_id}"
        return cls(tuple(f"{prefix}-{rank}.sock" for rank in range(world_size)),
                   f"{prefix}-responses.sock")

    @classmethod
    def tcp(cls, world_size: int, *, base_port: int,
            host: str = LookupConfig.model_fields["host"].default) -> LookupEndpoints:
        _check_layout("tcp", world_size)
        if not 0 < base_port <= 65535 - world_size:
            raise ValueError(f"base_port {base_port}: needs {world_size + 1} ports below 65536")
        return cls(tuple(f"tcp://{host}:{base_port + rank}" for rank in range(world_size)),
                   f"tcp://{host}:{base_port + world_size}")


    @classmethod
    def from_config(cls, lookup: LookupConfig, engine_id: str,
                    world_size: int) -> LookupEndpoints:
        """The endpoints a config's ``lookup`` section names for ``engine_id``
        (validated: ``LookupConfig`` already holds tcp to a ``base_port``)."""
        if lookup.transport == "ipc":
            return cls.ipc(engine_id, world_size, lookup.runtime_dir).secured(lookup)
        assert lookup.base_port is not None  # LookupConfig's rule for tcp
        endpoints = cls.tcp(world_size, host=lookup.host, base_port=lookup.base_port)
        return endpoints.secured(lookup)

    def secured(self, lookup: LookupConfig) -> LookupEndpoints:
        """These endpoints with the CURVE keys of ``lookup.curve`` (unchanged without)."""
        if lookup.curve is None:
            if lookup.transport == "tcp" and not is_loopback_host(lookup.host):
                # lookup.insecure let this through: say so at every start
                logger.warning("lmkv lookup: INSECURE: tcp on %s without CURVE "
                               "(lookup.insecure): anyone who reaches these ports can read "
                               "and answer lookups", lookup.host)
            return self
        return LookupEndpoints(self.requests, self.responses, peer_keys(lookup.curve))


def _check_layout(engine_id: str, world_size: int) -> None:
    if not _ENGINE_ID.match(engine_id):
        raise ValueError(f"engine_id {engine_id!r}: use 1-64 characters of "
                         "letters, digits, '.', '_' and '-' (it names socket files)")
    if world_size <= 0:
        raise ValueError(f"world_size {world_size}: must be a positive integer")


def check_endpoint(endpoint: str) -> None:
    """ValueError unless ``endpoint`` is a usable ``ipc://`` or ``tcp://`` address."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError(f"{endpoint}: ipc paths must be absolute")
        if len(path.encode()) > MAX_IPC_PATH_BYTES:
            raise ValueError(f"{endpoint}: the socket path is {len(path.encode())} bytes; "
                             f"unix sockets allow {MAX_IPC_PATH_BYTES} (use a shorter runtime_dir)")
    elif endpoint.startswith("tcp://"):
        if ":" not in endpoint[len("tcp://"):]:
            raise ValueError(f"{endpoint}: tcp endpoints need a port")
    else:
        raise ValueError(f"{endpoint}: the lookup channel speaks ipc:// or tcp://")


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` owner-only (0700), or check that an existing one is
    private: a directory (not a link), owned by this user, not writable by group
    or others. Otherwise ConfigError, one line naming the directory and the problem."""
    problem = make_private_dir(directory)
    if problem:
        raise ConfigError(f"lookup runtime_dir {directory} {problem}; refusing to use it "
                          "for lookup sockets (set lookup.runtime_dir to a private directory)")


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def prepare_bind(endpoint: str) -> None:
    """Make sure an ipc endpoint's directory is private (creating it 0700)."""
    path = _ipc_path(endpoint)
    if path is not None:
        ensure_private_dir(path.parent)


def push_socket(context: zmq.Context, endpoint: str, *,
                curve: CurveKeys | None = None) -> zmq.Socket:
    # Connecting into a runtime directory someone else controls would hand them
    # the lookups: the same check as for binding.
    prepare_bind(endpoint)
    sock = context.socket(zmq.PUSH)
    if curve is not None:
        secure_client(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    # The peer may bind later or restart: retry soon (ZMQ's default is 100 ms).
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.connect(endpoint)
    return sock


def pull_socket(context: zmq.Context, endpoint: str,
                max_message_bytes: int = MAX_MESSAGE_BYTES, *,
                curve: CurveAuthenticator | None = None) -> zmq.Socket:
    """A bound PULL socket; ``last_endpoint(sock)`` tells the port of ``tcp://host:*``.
    A message over ``max_message_bytes`` disconnects its sender (it is never received)."""
    prepare_bind(endpoint)
    sock = context.socket(zmq.PULL)
    if curve is not None:
        curve.secure(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # never drop: the peers' HWM bounds the queue
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.bind(endpoint)
    path = _ipc_path(endpoint)
    if path is not None:  # the directory is private already; the file is too
        os.chmod(path, 0o600)
    return sock


def last_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def close_all(sockets: Sequence[zmq.Socket]) -> None:
    for sock in sockets:
        sock.close(linger=0)


class Waker:
    """Wakes a thread blocked in ``zmq.Poller.poll`` (so that close is immediate)."""

    def __init__(self, context: zmq.Context) -> None:
        address = f"inproc://lmkv-lookup-wake-{id(self):x}"
        self.socket = context.socket(zmq.PAIR)  # polled by the thread that sleeps
        self.socket.bind(address)
        self._sender = context.socket(zmq.PAIR)  # used by the thread that wakes it
        self._sender.connect(address)

    def wake(self) -> None:
        with contextlib.suppress(zmq.Again):  # a wake-up is already queued
            self._sender.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        close_all([self.socket, self._sender])
