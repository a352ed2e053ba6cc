"""The ``lmkv`` command: plugins, config check, stats, server, keygen, replay, migrate
and the demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmkv import __version__
from lmkv.base.errors import (
    ERROR_PREFIX,
    LMKVError,
    OneLineArgumentParser,
    run_reporting_errors,
)
from lmkv.base.logutil import LOG_LEVELS, configure_logging
from lmkv.contracts.versions import API_VERSIONS, api_summary

if TYPE_CHECKING:
    from lmkv.config.model import LMKVConfig
    from lmkv.rpc.protocol import StatsReply

# Everything else is imported inside the command that needs it: `lmkv --help` and
# `lmkv --version` must not pay for torch (lmkv/__init__ imports lazily too).

def _cmd_plugins(args: argparse.Namespace) -> int:
    from lmkv.plugins.contract import declared_version
    from lmkv.plugins.manager import get_plugin_manager
    from lmkv.plugins.registry import KINDS

    manager = get_plugin_manager()
    registry = manager.registry
    plugins = [{"kind": e.kind, "name": e.name, "distribution": e.source.distribution,
                "version": e.source.version, "entry_point": e.source.plugin,
                "api_version": _shown_version(
                    declared_version(e.cls, KINDS[e.kind].base_class()))}
               for e in registry.entries()]
    errors = [{"entry_point": f.source.plugin, "distribution": f.source.distribution,
               "version": f.source.version, "error": f.error} for f in registry.failures]
    skipped = [{"entry_point": s.source.plugin, "distribution": s.source.distribution,
                "reason": s.reason} for s in manager.skipped]
    if args.json:
        print(json.dumps({"lmkv": __version__, "api_versions": API_VERSIONS,
                          "plugins": plugins, "errors": errors, "skipped": skipped}, indent=2))
        return 0
    print(f"lmkv {__version__} ({api_summary()})\n")
    header = ("KIND", "NAME", "API", "DISTRIBUTION", "VERSION", "ENTRY POINT")
    rows = [header] + [(p["kind"], p["name"], p["api_version"] or "-",
                        p["distribution"] or "-", p["version"] or "-", p["entry_point"])
                       for p in plugins]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if errors:
        print("\nplugins left out (see docs/migrating-plugins.md):")
        for e in errors:
            print(f"  {e['entry_point']} ({e['distribution']} {e['version']}): {e['error']}")
    if skipped:
        print("\nplugins skipped:")
        for s in skipped:
            print(f"  {s['entry_point']} ({s['distribution']}): {s['reason']}")
    return 0


def _shown_version(declared: object) -> str | None:
    """A class's ``api_version`` for the listing (None: it declares none)."""
    return None if declared is None else str(declared)


def _cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from lmkv.cli.check import dry_run
    from lmkv.config.model import load_config

    config = load_config(args.file)
    # Valid whatever this moment's free memory; what will not work here now is said
    # on stderr, so stdout stays the config alone.
    for line in config.startup_warnings():
        print(f"lmkv config check: warning: {line}", file=sys.stderr)
    problems = dry_run(config)
    if problems:
        raise LMKVError("\n".join(problems))
    print(f"# {args.file}: valid, every plugin it names built (dry run); resolved "
          "configuration:")
    print(yaml.safe_dump(config.resolved_dump(), sort_keys=False).rstrip())
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from lmkv.config.model import load_config

    config = load_config(args.config)
    address = args.server or config.server.address
    if not (args.server and address.startswith(("http://", "https://"))):
        check_server_address(address, "--server" if args.server else "server.address",
                             ", or http://HOST:PORT (a metrics endpoint)" if args.server
                             else "")
    if args.watch is None:
        # An address given on the command line is the server asked for: nothing
        # there is an error, never another process's (empty) tiers in its place.
        return _show_stats(address, config, args.json, fallback=not args.server)
    try:
        _show_stats(address, config, args.json, fallback=False)  # unreachable: one line
        while True:
            time.sleep(args.watch)
            print(f"--- {time.strftime('%H:%M:%S')}", flush=True)
            try:
                _show_stats(address, config, args.json, fallback=False)
            except LMKVError as exc:  # gone meanwhile: say so, keep watching
                print(f"lmkv: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 0


def _show_stats(address: str, config: LMKVConfig, as_json: bool, *, fallback: bool) -> int:
    """One reading: the server's RPC stats (tiers, server counters, its recorded
    figures), or an http(s) metrics endpoint scraped. ``fallback``: when no server
    answers, say so and show the config's tiers opened now; else LMKVError."""
    from lmkv.metrics.tier_text import format_figures, format_tier_stats

    figures: dict[str, object] = {}
    server: dict[str, object] | None = None
    live = True
    if address.startswith(("http://", "https://")):
        from lmkv.metrics.scrape import scrape

        figures, tiers = scrape(address, config.server.timeout_ms / 1e3 + 5.0)
    else:
        reply, why = _live_stats(address, config)
        absent = (f"cannot connect to the lmkv server at {address}: {why}" if why
                  else f"no lmkv server answers at {address}")
        if reply is None and not fallback:
            raise LMKVError(absent)
        if reply is None:
            # A fresh copy of the tiers would show every memory tier empty: say so in
            # one line, then show what a fresh open does see (fs and redis keep entries).
            # Said once the tiers opened: when one cannot, its error is the one line.
            tiers = _fresh_tier_stats(config)
            print(f"lmkv: {absent}: nothing live to show; "
                  "the figures below are of the config's tiers opened now (memory tiers "
                  "start empty); give --server ADDRESS for a running server",
                  file=sys.stderr)
            live = False
        else:
            import msgspec

            tiers, server = reply.tiers, msgspec.to_builtins(reply.server)
            figures = reply.metrics
    if as_json:
        print(json.dumps({"server": address, "live": live, "server_stats": server,
                          "metrics": figures, "tiers": tiers}, indent=2, default=str),
              flush=True)
        return 0
    if server is not None:
        print(f"server {address}: " + ", ".join(f"{k}={v}" for k, v in server.items()))
    if figures:
        print("\n".join(format_figures(figures)))
    print("\n".join(format_tier_stats(tiers, indent="")), flush=True)
    return 0


SERVER_ADDRESS_FORMS = "tcp://HOST:PORT (port 1-65535), HOST:PORT or ipc://PATH"


def check_server_address(address: str, where: str, more_forms: str = "") -> None:
    """ConfigError naming ``where`` unless ``address`` is one a client can connect to:
    zmq would raise a bare "Invalid argument" from deep inside the client."""
    from urllib.parse import urlsplit

    url = address if "://" in address else f"tcp://{address}"
    scheme = url.split("://", 1)[0]
    problem = None
    if scheme == "ipc":
        problem = None if url[len("ipc://"):] else "names no socket path"
    elif scheme == "tcp":
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            port, parts = None, None
        if parts is None or not parts.hostname or port is None or not 0 < port < 65536:
            problem = "names no host and port"
    else:
        problem = f"has scheme {scheme!r}"
    if problem:
        raise LMKVError(f"{where} = {address!r} {problem}; allowed: {SERVER_ADDRESS_FORMS}"
                        f"{more_forms}")


def _live_stats(address: str, config: LMKVConfig) -> tuple[StatsReply | None, str]:
    """The running server's StatsReply and ""; or None, and why when the connection
    says (a CURVE mismatch), when none answers at ``address``."""
    from lmkv.rpc.auth import client_keys
    from lmkv.rpc.client import ServerClient

    section = config.server
    curve = client_keys(section.curve) if section.curve is not None else None
    client_log = logging.getLogger("lmkv.rpc.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)  # "no server" is said once, by the caller
    try:
        with ServerClient(address, timeout_ms=section.timeout_ms, data_path="inline",
                          curve=curve) as client:
            reply = client.stats()
            # A busy machine may not have ended the handshake when the request gave up.
            return reply, client.connection_problem(wait_ms=2000) if reply is None else ""
    finally:
        client_log.setLevel(level)


def _fresh_tier_stats(config: LMKVConfig) -> list[dict[str, object]]:
    from lmkv.storage.manager import StorageManager

    storage = StorageManager.from_config(config)
    try:
        return storage.stats()
    finally:
        storage.close()


def _cmd_keygen(args: argparse.Namespace) -> int:
    from lmkv.rpc.auth import load_public_key, write_keypair

    public, secret = write_keypair(args.dir, args.name, force=args.force)
    print(f"public key:  {public}  ({load_public_key(public).decode()})")
    print(f"secret key:  {secret}  (mode 0600: keep it private)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from lmkv.cli.demo import run_demo

    return run_demo(args)


def _watch_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 86400:  # nan too
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds from 0.1 "
                                          "to 86400")
    return value


class _Version(argparse.Action):
    """``--version``: the line as it is (argparse's own action wraps it to the
    terminal's width)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show the version and the plugin API, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"lmkv {__version__} ({api_summary()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="lmkv", description="lmkv: a tiered KV-cache layer")
    parser.add_argument("--version", action=_Version)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default WARNING, INFO for `lmkv server`; "
                             "env LMKV_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins and load errors")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(func=_cmd_plugins)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate FILE and print the resolved config")
    check.add_argument("file")
    check.set_defaults(func=_cmd_config_check)

    stats = sub.add_parser(
        "stats", help="live figures of a running lmkv server (or a metrics endpoint)",
        description="Ask the lmkv server at ADDRESS for its live figures: lookups, loads, "
                    "stores, latencies and its tiers. An http://HOST:PORT address reads a "
                    "metrics endpoint instead (lmkv server --metrics-port, metrics.port). "
                    "When no server answers at --server ADDRESS, that is one line and "
                    "exit 2; without --server, say so in one line (stderr) and show the "
                    "config's tiers opened now (memory tiers start empty).")
    stats.add_argument("--config", help="config file (default: LMKV_CONFIG / defaults)")
    stats.add_argument("--server", metavar="ADDRESS",
                       help="the lmkv server to ask (default: the config's server.address), "
                            "or http://HOST:PORT, a metrics endpoint")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--watch", type=_watch_seconds, metavar="SECONDS",
                       help="show the figures again every SECONDS until Ctrl-C (a server "
                            "that stops answering is said in one line; watching goes on)")
    stats.set_defaults(func=_cmd_stats)

    keygen = sub.add_parser(
        "keygen", help="write a CURVE key pair for the lmkv server or the lookup channel",
        description="Write NAME.key (the public key, to hand to peers) and NAME.key_secret "
                    "(the key pair, mode 0600) into DIR. See docs/security.md.")
    keygen.add_argument("--dir", default=".",
                        help="directory to write to (created 0700; default: .)")
    keygen.add_argument("--name", default="lmkv", help="file name stem (default: lmkv)")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")
    keygen.set_defaults(func=_cmd_keygen)

    from lmkv.server.defaults import DEFAULT_LOG_LEVEL
    from lmkv.server.main import add_server_arguments, run_server

    server = sub.add_parser("server",
                            help="serve the tiers of a config to several engine processes")
    add_server_arguments(server)
    server.set_defaults(func=run_server, default_log_level=DEFAULT_LOG_LEVEL)

    from lmkv.replay.command import add_replay_arguments, run_replay

    replay = sub.add_parser("replay", help="replay a request trace: hit ratio per eviction "
                                           "policy and capacity against the optimum")
    add_replay_arguments(replay)
    replay.set_defaults(func=run_replay)

    from lmkv.cli.migrate import add_migrate_arguments, run_migrate

    migrate = sub.add_parser(
        "migrate", help="print the lmkv config equivalent to an LMCache config",
        description="Read LMCache's YAML config FILE and the LMCACHE_* variables (they "
                    "win, as in LMCache) and print the equivalent lmkv config as YAML. "
                    "Each option that does not carry over is one line on stderr, naming "
                    "it and why. See docs/vllm.md.")
    add_migrate_arguments(migrate)
    migrate.set_defaults(func=run_migrate)

    from lmkv.cli.demo import add_demo_arguments

    demo = sub.add_parser("demo", help="cold vs warm time to first token on a local model")
    add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = configure_logging(getattr(args, "log_level", None),
                                getattr(args, "default_log_level", "WARNING"))
    if problem:
        print(f"{ERROR_PREFIX}{problem}", file=sys.stderr)
        return 2
    return run_reporting_errors(args.func, args)
