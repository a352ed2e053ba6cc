"""How a tier's run-time faults become misses, dropped writes and counters.

One policy for every tier, so a plugin author writes none of it and every
tier degrades the same way (``StorageBackend.faults`` holds a tier's
``TierFaults``; ``StorageBackend.drop_corrupt`` handles corrupt entries):

- **A fault of one operation** (an I/O error, a refused command): the
  operation answers a miss or drops its writes; ``errors`` counts it and a
  warning is logged at a bounded rate, with the tier's secrets masked.
- **Storage unreachable** (an error the tier declares in its
  ``unreachable`` errors, ``TierUnavailable`` by default): the same, and the
  breaker opens. While it is open, operations fail at once with
  ``BreakerOpen`` instead of each waiting for a timeout; they are misses or
  dropped writes but not errors (nothing was attempted). After a short,
  growing interval one operation at a time probes the storage; the first
  that gets an answer closes the breaker. No restart, no operator.
- **Anything else is a bug**, not a fault: it raises out of the tier, so
  it is never counted as a storage fault. The storage manager's last-resort
  guard (``TierFaults.last_resort``) catches it, logs it at ERROR with its
  traceback, and answers a miss or drops the writes: the engine never stops.
- **After close** everything a closing tier's calls raise is absorbed and
  nothing more is counted: sockets pulled from under calls in flight fail in
  assorted ways, and nobody is listening any more.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass

from lmkv.base.logutil import RateLimitedLog
from lmkv.keys.chunking import CacheKey

logger = logging.getLogger(__name__)

#: Default breaker intervals: a stopped endpoint costs one timeout per interval.
FIRST_BACKOFF_S = 0.25
LONGEST_BACKOFF_S = 2.0


class TierUnavailable(ConnectionError):
    """The tier's storage cannot be reached: raise it (``from`` the client
    library's error) so the fault policy opens the tier's breaker."""


class BreakerOpen(TierUnavailable):
    """The storage failed recently and the breaker is open: not attempted."""


@dataclass
class TierCounters:
    """What every tier counts. Increment from any thread: the GIL keeps ``+=`` on
    an attribute of a shared object cheap, and a rare lost increment in a
    counter is acceptable (they are for observability, not accounting)."""

    hits: int = 0  # chunks found by a get
    misses: int = 0  # gets that found nothing (including corrupt frames, errors)
    puts: int = 0  # chunks stored
    bytes_in: int = 0  # bytes written to the tier
    bytes_out: int = 0  # bytes read from the tier
    evictions: int = 0
    errors: int = 0  # operations that failed (connection lost, I/O error, ...)
    dropped_writes: int = 0  # puts refused or lost (no room, tier down, queue full)
    corrupt_frames: int = 0  # stored entries that failed to decode; removed
    admission_rejects: int = 0  # chunks offered before their admit_after-th sighting

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class Breaker:
    """Fails fast while the storage is down; lets one probe through per interval.

    The interval starts at ``first_backoff_s`` and doubles with each failed
    probe up to ``longest_backoff_s``; a first backoff of 0 never opens.
    """

    def __init__(self, first_backoff_s: float = FIRST_BACKOFF_S,
                 longest_backoff_s: float = LONGEST_BACKOFF_S) -> None:
        self.first_backoff_s = first_backoff_s
        self.longest_backoff_s = max(first_backoff_s, longest_backoff_s)
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._until = 0.0
        self._reason = ""

    @property
    def is_open(self) -> bool:
        """Whether an operation started now would be refused (asks, never probes)."""
        return bool(self._backoff) and time.monotonic() < self._until

    def check(self) -> None:
        """Raise ``BreakerOpen`` while open; once the interval is over, the caller
        that gets through is the probe and the others keep waiting."""
        if not self._backoff:
            return
        with self._lock:
            now = time.monotonic()
            if now < self._until:
                raise BreakerOpen(f"storage unavailable ({self._reason}); "
                                  f"retrying within {self._until - now:.1f}s")
            self._until = now + self._backoff

    def failed(self, exc: BaseException) -> None:
        if not self.first_backoff_s:
            return
        with self._lock:
            self._backoff = min(self.longest_backoff_s, self._backoff * 2 or self.first_backoff_s)
            self._until = time.monotonic() + self._backoff
            self._reason = f"{type(exc).__name__}: {exc}"[:200]

    def succeeded(self) -> None:
        if self._backoff:
            with self._lock:
                self._backoff = self._until = 0.0


class TierFaults:
    """One tier's fault policy: which errors it absorbs, which mean unreachable,
    its breaker and its rate-limited fault log.

    Each tier declares what it absorbs (``absorbed``: its storage library's
    errors); the default is OSError, I/O errors, of which ``TierUnavailable``
    is one. ``TierUnavailable`` is always absorbed.

    It holds the tier's counters, never the tier: the parts of a tier (a
    connection, a reader, a writer) share it without holding the tier.
    """

    def __init__(self, counters: TierCounters, where: str, *,
                 absorbed: tuple[type[BaseException], ...] = (OSError,),
                 unreachable: tuple[type[BaseException], ...] = (TierUnavailable,),
                 breaker: Breaker | None = None,
                 redact: Callable[[object], str] = str,
                 log: logging.Logger | None = None) -> None:
        self.counters = counters
        self.where = where  # "fs tier /data/kv": how log lines name the tier
        self.absorbed = absorbed
        self.unreachable = unreachable
        self.breaker = breaker or Breaker()
        self.redact = redact  # masks the tier's secrets in a client library's message
        self.closed = False
        #: Bugs the last resort caught (exceptions that are no storage fault), and
        #: the first one on one line: a caller that must not go on with a broken
        #: tier or policy (``lmkv replay``) reads them.
        self.bugs = 0
        self.first_bug = ""
        self._log = RateLimitedLog(log or logger)  # the tier's logger: its name filters

    def absorbs(self, exc: BaseException) -> bool:
        """Whether ``exc`` becomes a miss or a dropped write rather than raising:
        a declared fault, or anything once the tier is closed."""
        return self.closed or isinstance(exc, (TierUnavailable, *self.absorbed))

    def check(self) -> None:
        """Before touching the storage: ``BreakerOpen`` while the breaker is open."""
        self.breaker.check()

    def succeeded(self) -> None:
        """The storage answered (even with "no such entry"): close the breaker."""
        self.breaker.succeeded()

    def fault(self, op: str, exc: BaseException, consequence: str,
              detail: str | CacheKey = "") -> None:
        """Count and log one failed operation; an unreachable storage opens the
        breaker. ``consequence`` says what the caller got instead; ``detail`` (a
        key is named only here, when something failed) what it was about."""
        if self.closed or isinstance(exc, BreakerOpen):
            return  # nothing was attempted, or nobody is listening any more
        if isinstance(detail, CacheKey):
            detail = detail.to_string()
        self.counters.errors += 1
        if isinstance(exc, self.unreachable):
            self.breaker.failed(exc)
        self._log.warning(f"{op}:{type(exc).__name__}", "lmkv %s: %s%s failed (%s: %s); %s",
                          self.where, op, f" {detail}" if detail else "",
                          type(exc).__name__, self.redact(exc), consequence)

    @contextmanager
    def guard(self, op: str, consequence: str, detail: str | CacheKey = ""
              ) -> Iterator[None]:
        """Run an operation's block: an error the tier absorbs is counted
        (``fault``) and swallowed, anything else raises (a bug must show). The
        caller answers its miss or drops its writes when the block did not
        finish. The breaker is asked where the storage is touched (``check``
        before a request, ``succeeded`` once it is answered), not here: one
        operation may make several requests."""
        try:
            yield
        except Exception as exc:
            if not self.absorbs(exc):
                raise
            self.fault(op, exc, consequence, detail)

    def last_resort(self, op: str, exc: BaseException, consequence: str) -> None:
        """The storage manager's guard around a call into the tier: a fault the
        tier absorbs is counted (``fault``); anything else is a bug in the tier,
        logged at ERROR with its traceback (at a bounded rate) and not counted as a
        storage fault. Either way the caller gets ``consequence`` and carries on. A
        cancelled operation (the tier closing under it) counts as a fault."""
        if self.absorbs(exc) or isinstance(exc, CancelledError):
            self.fault(op, exc, consequence)
            return
        self.bugs += 1
        if not self.first_bug:
            self.first_bug = f"{op} raised {' '.join(f'{type(exc).__name__}: {exc}'.split())}"
        self._log.log(logging.ERROR, f"bug:{op}:{type(exc).__name__}",
                      "lmkv %s: %s raised %s, a bug in the tier (not a storage fault); %s\n%s",
                      self.where, op, type(exc).__name__, consequence, _Traceback(exc))

    def corrupt(self, entry: str, problem: object) -> None:
        """Count and log one corrupt entry (``StorageBackend.drop_corrupt`` also
        removes it; call this alone for an entry already gone)."""
        self.counters.corrupt_frames += 1
        self.note("corrupt", "dropping corrupt entry %s: %s", entry, problem)

    def note(self, key: str, msg: str, *args: object) -> None:
        """A rate-limited warning about the tier's data (a missing part, ...)."""
        self._log.warning(key, "lmkv %s: " + msg, self.where, *args)

    def close(self) -> None:
        self.closed = True


class _Traceback:
    """An exception's traceback, formatted only if the rate-limited line is logged."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __str__(self) -> str:
        exc = self.exc
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
