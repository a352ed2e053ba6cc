"""Rate-limited logging for hot paths: a fault repeated every step logs once a while."""

from __future__ import annotations

import logging
import os
import threading
import time

# The levels `lmkv --log-level` and `python -m lmkv.server --log-level` take.
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_LEVEL_ENV = "LMKV_LOG_LEVEL"


def configure_logging(flag: str | None, default: str) -> str | None:
    """Set up the root logger for an lmkv command (``lmkv ...``, ``python -m
    lmkv.server``): ``--log-level``, else ``LMKV_LOG_LEVEL``, else ``default``.
    Returns a one-line error when the level is not one of ``LOG_LEVELS``.

    Below WARNING only lmkv's loggers and its plugins' (``lmkv*``) get through:
    other libraries' debug lines carry what lmkv redacts (botocore logs the S3
    endpoint URL with its credentials, and the session token)."""
    level = (flag or os.environ.get(LOG_LEVEL_ENV) or default).upper()
    if level not in LOG_LEVELS:
        return f"{LOG_LEVEL_ENV} = {level!r}: allowed: {', '.join(LOG_LEVELS)}"
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lmkv").setLevel(logging.NOTSET)  # the root's level, as asked
    for handler in logging.getLogger().handlers:
        handler.addFilter(_own_debug_only)
    return None


def log_where_nothing_does() -> str | None:
    """Give lmkv's loggers a stderr handler when nothing handles them: inside another
    program (vLLM, whose own logger does not propagate) lmkv's lines would otherwise
    be lost below WARNING and come out bare above. Nothing is changed where the
    ``lmkv`` logger or the root logger has a handler already (the program or the
    user configured logging), and the handler stands aside once the root logger
    has one (a program that configures logging later). The level is
    ``LMKV_LOG_LEVEL``, else INFO; returns a one-line warning (logged too) when
    that is not one of ``LOG_LEVELS``."""
    own = logging.getLogger("lmkv")
    if own.handlers or logging.getLogger().handlers:
        return None
    level = (os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    problem = None
    if level not in LOG_LEVELS:
        problem = (f"{LOG_LEVEL_ENV} = {level!r}: allowed: {', '.join(LOG_LEVELS)}; "
                   "lmkv logs at INFO")
        level = "INFO"
    handler = _UntilRootHandles()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [lmkv] %(message)s",
                                           "%m-%d %H:%M:%S"))
    own.addHandler(handler)
    own.setLevel(level)
    if problem:
        own.warning(problem)
    return problem


class _UntilRootHandles(logging.StreamHandler):
    """Writes to stderr while the root logger has no handler (then lmkv's lines
    propagate to the program's own)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _own_debug_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.startswith("lmkv")


class RateLimitedLog:
    """Logs each distinct ``key`` at most once per ``interval_s``, counting the rest."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self.logger.log(level, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)
