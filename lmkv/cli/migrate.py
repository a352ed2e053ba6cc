"""``lmkv migrate [FILE]``: an LMCache config (file and ``LMCACHE_*`` env) as lmkv's.

Reads LMCache's settings the way LMCache does (the YAML file, then ``LMCACHE_*``
variables over it), translates them with lmkv.config.lmcache, and prints the lmkv
config as YAML on stdout: a file ``lmkv config check`` accepts. Each option that
does not carry over is one line on stderr naming it (as it was spelt: the YAML
key or the variable) and why, so stdout stays a clean config to redirect.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from lmkv.base.errors import ConfigError
from lmkv.config.lmcache import CONFIG_FILE_ENV, ENV_ONLY, ENV_PREFIX, Translation, translate

PROG = "lmkv migrate"


def add_migrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", nargs="?", metavar="FILE",
        help="LMCache's YAML config file, .yaml or .yml (default: LMCACHE_CONFIG_FILE "
             "when set; without either, the LMCACHE_* variables alone)")


def read_lmcache_settings(path: str | None, env: Mapping[str, str]
                          ) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """LMCache's settings from ``path`` and ``LMCACHE_*`` variables (those win): the
    values by option name, how each was spelt (for messages), and the variables
    that are not options (with what becomes of them)."""
    from lmkv.config.model import read_config_file

    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    others: list[tuple[str, str]] = []
    if path:
        for key, value in read_config_file(path).items():
            values[key] = value
            labels[key] = f"{key!r} (from {path})"
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        if name in ENV_ONLY:
            others.append((name, ENV_ONLY[name]))
            continue
        option = name[len(ENV_PREFIX):].lower()
        values[option] = env[name]
        labels[option] = name
    return values, labels, others


def migrate(path: str | None, env: Mapping[str, str]) -> tuple[Translation, list[str]]:
    """The translation of the LMCache settings at ``path`` and in ``env``, and one
    line per option that did not carry over."""
    values, labels, others = read_lmcache_settings(path, env)
    result = translate(values, labels)
    lines = [f"not carried: {_label(name, labels)}: {why}" for name, why in result.dropped]
    lines += [f"not carried: {name}: {why}" for name, why in others]
    return result, lines


def _label(name: str, labels: Mapping[str, str]) -> str:
    """How an option was spelt; a key inside one (``extra_config.protocol``) is named
    with the option it came in."""
    if name in labels:
        return labels[name]
    parent, dot, key = name.partition(".")
    return f"{labels[parent]} key {key!r}" if dot and parent in labels else repr(name)


def run_migrate(args: argparse.Namespace) -> int:
    import yaml

    env = os.environ
    path = args.file or env.get(CONFIG_FILE_ENV) or None
    result, lines = migrate(path, env)
    config = result.nested()
    problem = _load_problem(result)
    source = path or "LMCACHE_* variables"
    print(f"# lmkv config migrated from LMCache ({source}) by lmkv migrate")
    print(yaml.safe_dump(config, sort_keys=False).rstrip())
    for line in lines:
        print(f"{PROG}: {line}", file=sys.stderr)
    if problem:
        print(f"{PROG}: warning: this lmkv cannot load the result as it is: {problem}",
              file=sys.stderr)
    return 0


def _load_problem(result: Translation) -> str | None:
    """The first line lmkv's loader reports on the result (a plugin that is not
    installed here, such as lmkv-redis), or None when it loads."""
    from lmkv.config.model import load_config

    try:
        load_config(overrides=result.settings, env={})
    except ConfigError as exc:
        return str(exc).splitlines()[0]
    return None
