"""``python -m lmkv.server`` (and ``lmkv server``): options, start-up and shutdown.

Start-up opens the tiers of the config. The first tier that holds memory (the
cpu tier) is asked to place its arena in shared memory (``ArenaPlacement.SHARED``)
unless its config sets ``shared_memory: false``, so clients on this machine copy
chunks straight into and out of it; when no segment can be made (no room in
/dev/shm) the tier warns and the server serves the inline data path only.
SIGTERM or SIGINT stops serving, releases what clients held, waits for queued
lower-tier stores, logs the final tier figures, closes the tiers (unlinking the
segment) and exits 0. A second signal cuts the wait short.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import logging
import math
import os
import signal
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmkv.base.errors import OneLineArgumentParser, byte_size_type, run_reporting_errors
from lmkv.base.logutil import LOG_LEVELS, configure_logging
from lmkv.server.defaults import (
    DEFAULT_HANDLE_TTL_S,
    DEFAULT_LOG_LEVEL,
    DEFAULT_QUARANTINE_GRACE_S,
)

# Config, storage and pydantic are imported where used: `lmkv --help` builds this
# parser and must not pay for torch.
if TYPE_CHECKING:
    from lmkv.config.model import LMKVConfig
    from lmkv.rpc.auth import CurveKeys
    from lmkv.server.sessions import SessionLimits
    from lmkv.storage.manager import StorageManager

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_MAX_REQUEST_BYTES = 256 << 20



def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:  # not "\u0663"
        raise argparse.ArgumentTypeError(f"{text!r}: must be a port number 0-65535")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # nan and inf too: a timeout must end
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds, 0 or more")
    return value


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="lmkv config file with the tiers to serve (default: LMKV_CONFIG, "
                             "else one 4GiB cpu tier)")
    parser.add_argument("--socket", metavar="PATH",
                        help="listen on this ipc socket (its directory must be private: "
                             "created 0700); default without --host/--port: server.sock in "
                             "this user's runtime directory, which no other user can reach")
    parser.add_argument("--host",
                        help=f"listen on TCP at this address (default {DEFAULT_HOST} when "
                             "--port is given); every local user can reach a TCP port: use "
                             "CURVE where others share the machine")
    parser.add_argument("--port", type=_port,
                        help=f"TCP port (default {DEFAULT_PORT} when --host is given; 0: any "
                             "free port)")
    parser.add_argument("--max-request-bytes", type=byte_size_type(4096),
                        default=DEFAULT_MAX_REQUEST_BYTES, metavar="SIZE",
                        help="larger requests get a too_large error reply (default 256MiB)")
    parser.add_argument("--session-timeout", type=_positive_float, default=60.0,
                        metavar="SECONDS",
                        help="release what a client holds once it has been silent this long "
                             "(default 60)")
    parser.add_argument("--handle-ttl", type=_positive_float, default=DEFAULT_HANDLE_TTL_S,
                        metavar="SECONDS",
                        help="release chunk buffers lent to a client that has neither used "
                             "nor renewed them for this long; shared-memory ones are "
                             f"quarantined instead (default {DEFAULT_HANDLE_TTL_S:g})")
    parser.add_argument("--quarantine-grace", type=_positive_float,
                        default=DEFAULT_QUARANTINE_GRACE_S, metavar="SECONDS",
                        help="free quarantined buffers of a client whose process the server "
                             "cannot check after it has been silent this long (default "
                             f"{DEFAULT_QUARANTINE_GRACE_S:g})")
    parser.add_argument("--drain-timeout", type=_non_negative_float, default=30.0,
                        metavar="SECONDS",
                        help="at shutdown, wait this long for queued lower-tier stores "
                             "(default 30; 0: do not wait, drop what is queued)")
    parser.add_argument("--curve-secret-key", metavar="FILE",
                        help="CURVE: the server's key pair (a .key_secret file from `lmkv "
                             "keygen`, owner-only); default: server.curve.secret_key")
    parser.add_argument("--curve-authorized-keys", metavar="PATH",
                        help="CURVE: the public keys allowed to connect (a .key file or a "
                             "directory of them); default: server.curve.authorized_keys")
    # SUPPRESS: `lmkv --log-level X server` and `lmkv server --log-level X` both work,
    # and an absent flag does not hide the top-level one.
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=argparse.SUPPRESS,
                        help="logging level (default INFO; env LMKV_LOG_LEVEL)")
    parser.add_argument("--metrics-port", type=_port, metavar="PORT",
                        help="serve Prometheus metrics (/metrics: lmkv_*) and /health over "
                             "HTTP on this port (docs/metrics.md); default: none")
    parser.add_argument("--metrics-host", metavar="ADDRESS",
                        help="address of the metrics endpoint (default 127.0.0.1; anything "
                             "else only when given here: the figures carry no KV, but say "
                             "what is cached how much)")
    parser.add_argument("--insecure", action="store_true",
                        help="serve a non-loopback address without CURVE: anyone who reaches "
                             "the port can read and plant KV (warned at each start)")


def build_storage(config: LMKVConfig) -> StorageManager:
    """The config's tiers, the first memory tier's arena in shared memory where it can
    be (the config is never edited: the tier honours the placement it is handed)."""
    from lmkv.contracts.tier import ArenaPlacement
    from lmkv.storage.manager import StorageManager

    return StorageManager.from_config(config, arena=ArenaPlacement.SHARED)


def endpoint_of(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def listen_endpoint(args: argparse.Namespace) -> str:
    """Where to listen: TCP with --host/--port, else the ipc socket (--socket, or this
    user's private default)."""
    from lmkv.base.private import default_server_address
    from lmkv.server.server import ServerError

    tcp = args.host is not None or args.port is not None
    if tcp and args.socket:
        raise ServerError("--socket and --host/--port name two places to listen; give one")
    if tcp:
        return endpoint_of(args.host or DEFAULT_HOST,
                           DEFAULT_PORT if args.port is None else args.port)
    return f"ipc://{os.path.abspath(args.socket)}" if args.socket else \
        default_server_address()


def check_host(host: str | None) -> None:
    """ServerError, one line, unless ``host`` is something ZMQ can listen on: an IP
    address, ``*``, a network interface or a name this machine resolves. Checked
    before anything else about the host, so a typo is not reported as a host that
    needs CURVE."""
    from lmkv.server.server import ServerError

    if host is None or host == "*":
        return
    name = host.strip("[]")
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    if name in {n for _, n in socket.if_nameindex()}:
        return
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ServerError(f"--host {host}: cannot be resolved ({reason}); give an IP "
                          "address, a network interface or a host name this machine "
                          "resolves") from None


def server_curve(args: argparse.Namespace, config: LMKVConfig) -> CurveKeys | None:
    """The server's CURVE keys from the flags, else the config's ``server.curve``; None
    without either. Refuses a non-loopback host without CURVE unless ``--insecure``."""
    from lmkv.config.model import is_loopback_host
    from lmkv.rpc.auth import server_keys
    from lmkv.server.server import ServerError

    section = config.server.curve
    secret = args.curve_secret_key or (section.secret_key if section else None)
    authorized = args.curve_authorized_keys or (section.authorized_keys if section else None)
    if secret is None and authorized is not None:
        raise ServerError("--curve-authorized-keys needs --curve-secret-key (the server's "
                          "own key pair)")
    curve = server_keys(secret, authorized) if secret is not None else None
    if curve is None and args.host is not None and not is_loopback_host(args.host):
        if not args.insecure:
            raise ServerError(
                f"--host {args.host} is not loopback and CURVE is off: anyone who reaches "
                "the port could read and plant KV; give --curve-secret-key and "
                "--curve-authorized-keys (docs/security.md), or --insecure")
        logger.warning("lmkv server: INSECURE: serving %s without CURVE (--insecure): anyone "
                       "who reaches this port can read every chunk and plant KV that engines "
                       "will load", args.host)
    return curve


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def tiers_line(storage: StorageManager) -> str:
    """The tiers served and the arena chunks live in, for the listening log line."""
    tiers = ", ".join(
        f"{t.name} ({_mib(t.capacity_bytes)})" if t.capacity_bytes else t.name
        for t in storage.tiers)
    memory = next((t for t in storage.tiers if t.holds_memory_objs), None)
    segment = getattr(memory, "shared_segment", None)
    if memory is None or not memory.capacity_bytes:
        arena = "no memory tier"
    elif segment is not None:
        pages = f"{segment.page_size >> 20} MiB huge" if segment.huge_pages \
            else f"{segment.page_size >> 10} KiB"
        why = f"; {segment.no_huge_pages}" if segment.no_huge_pages else ""
        arena = (f"{_mib(memory.capacity_bytes)} in shared memory {segment.name} "
                 f"({pages} pages{why})")
    else:
        arena = f"{_mib(memory.capacity_bytes)}, inline data path only"
    return f"tiers: {tiers or 'none'}; arena: {arena}"


def session_limits(config: LMKVConfig, storage: StorageManager) -> SessionLimits:
    """What one session may hold: the config's ``server.session_max_*``, by default
    half the memory tier's arena."""
    from lmkv.server.sessions import SessionLimits

    memory = next((t for t in storage.tiers if t.holds_memory_objs), None)
    return SessionLimits.of(config.server,
                            memory.capacity_bytes if memory is not None else None)


def limits_line(limits: SessionLimits) -> str:
    """What one session may hold, for the listening log line."""
    held = f"{limits.max_handles} handles"
    if limits.max_bytes is not None:
        held += f" and {_mib(limits.max_bytes)}"
    return f"a session holds at most {held}"


def access_line(endpoint: str, curve: CurveKeys | None) -> str:
    """Who can connect, for the listening log line."""
    if curve is not None:
        return f"CURVE, {len(curve.authorized)} authorized client keys"
    if endpoint.startswith("ipc://"):
        return "ipc socket in a private directory: this user only"
    return ("no CURVE: every user who can reach the port, on this machine too, can "
            "connect (docs/security.md)")


def start_metrics(args: argparse.Namespace) -> None:
    """The Prometheus endpoint of --metrics-port (before the tiers open: a port in
    use costs nothing); its tiers are added once they are open."""
    from lmkv.server.server import ServerError

    host = getattr(args, "metrics_host", None)
    port = getattr(args, "metrics_port", None)
    if port is None:
        if host is not None:
            raise ServerError("--metrics-host needs --metrics-port")
        return
    from lmkv.config.model import is_loopback_host
    from lmkv.metrics.exporter import DEFAULT_HOST as METRICS_HOST
    from lmkv.metrics.exporter import serve_metrics

    served = serve_metrics(port, host or METRICS_HOST)
    if not is_loopback_host(served.host):
        logger.warning("lmkv server: metrics served on %s (not loopback, as asked): whoever "
                       "reaches it reads the cache figures", served.url)


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; LMKVError (bad config, port in use) propagates."""
    from lmkv.config.model import load_config
    from lmkv.metrics import recorder
    from lmkv.server.server import KVServer

    check_host(args.host)
    config = load_config(args.config)
    curve = server_curve(args, config)  # before the tiers: a refusal costs nothing
    start_metrics(args)
    storage = build_storage(config)
    recorder().add_tier_source(storage.stats)
    # Everything allocated so far (torch, plugins, the tiers) lives as long as the
    # server: keep it out of the collector, so a full collection does not stall a
    # lookup for milliseconds.
    gc.freeze()
    try:
        limits = session_limits(config, storage)
        server = KVServer(storage, endpoint=listen_endpoint(args),
                          max_request_bytes=args.max_request_bytes,
                          session_timeout_s=args.session_timeout, curve=curve,
                          handle_ttl_s=args.handle_ttl,
                          quarantine_grace_s=args.quarantine_grace, limits=limits)
        endpoint = server.bind()
        signals = (signal.SIGTERM, signal.SIGINT)

        def on_signal(signum: int, frame: object) -> None:
            if server.stopping:
                raise KeyboardInterrupt  # a second signal: stop waiting
            logger.info("lmkv server: %s received; stopping", signal.Signals(signum).name)
            server.stop()

        previous = {s: signal.signal(s, on_signal) for s in signals}
        try:
            logger.info("lmkv server %s (pid %d) listening on %s; %s; %s; %s",
                        server.server_id, os.getpid(), endpoint, tiers_line(storage),
                        access_line(endpoint, curve), limits_line(limits))
            server.serve()
            server.close(args.drain_timeout)
            logger.info("lmkv server: final tier stats: %s",
                        json.dumps(storage.stats(), default=str))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            server.close(0.0)
    finally:
        # The writers' last flush: no longer than --drain-timeout asked for.
        storage.close(timeout=min(1.0, args.drain_timeout))
    logger.info("lmkv server %s: stopped", endpoint)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(
        prog="python -m lmkv.server",
        description="Serve lmkv's storage tiers to several engine processes.")
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    problem = configure_logging(getattr(args, "log_level", None), DEFAULT_LOG_LEVEL)
    if problem:
        parser.error(problem)
    return run_reporting_errors(run_server, args)
