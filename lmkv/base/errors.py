"""Exceptions raised by lmkv. Each one carries a message fit for one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

_Args = TypeVar("_Args")


class LMKVError(Exception):
    """Base class of every error lmkv raises on purpose."""


class ConfigError(LMKVError, ValueError):
    """A configuration value is invalid. One line per bad value, naming the key."""


class PluginError(LMKVError):
    """A plugin could not be registered, found or loaded."""


class DuplicatePluginError(PluginError):
    """Two plugins registered the same name for the same kind."""


class UnknownPluginError(PluginError, ConfigError):
    """A configuration selected a plugin name that no installed plugin provides.

    ``env_note``: when ``LMKV_LOAD_PLUGINS``/``LMKV_DISABLE_PLUGINS`` skipped plugins,
    the sentence saying so (also at the end of the message). Every name a config
    selects fails for that same reason, so config resolution says it once.
    """

    def __init__(self, message: str, *, env_note: str = "") -> None:
        super().__init__(f"{message}; {env_note}" if env_note else message)
        self.short = message
        self.env_note = env_note


class CorruptFrameError(LMKVError):
    """A stored frame failed to decode or verify; the storage layer treats it as a miss."""


class RefCountError(LMKVError, RuntimeError):
    """A reference or pin count went below zero: a double release."""


#: What every one-line error of every lmkv command starts with (``lmkv server``,
#: ``python -m lmkv.server`` and the other subcommands too), so one pattern finds them.
ERROR_PREFIX = "lmkv: error: "


def run_reporting_errors(func: Callable[[_Args], int], args: _Args) -> int:
    """Run a command (``lmkv ...``, ``python -m lmkv.server``): an LMKVError is one
    line per message line on stderr and exit 2; Ctrl-C is one line and exit 130."""
    try:
        return func(args)
    except LMKVError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"{ERROR_PREFIX}{line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmkv: interrupted", file=sys.stderr)
        return 130


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (argparse prints the whole usage first,
    which buries what is wrong), with lmkv's one prefix; ``--help`` still shows the
    usage, and the line names the command whose ``--help`` tells more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{ERROR_PREFIX}{' '.join(message.split())} "
                     f"(see {self.prog} --help)\n")


def byte_size_type(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for a byte size flag (``512MiB``, ``4096``) of at least
    ``minimum`` bytes; a bad value is argparse's one-line error."""

    def parse(text: str) -> int:
        from lmkv.base.units import ACCEPTED_FORMS, parse_byte_size  # pydantic: not for --help

        try:
            value = parse_byte_size(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {ACCEPTED_FORMS}") from None
        if value < minimum:
            unit = "byte" if minimum == 1 else "bytes"
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {minimum} {unit}")
        return value

    return parse

