"""What the tier does when Redis fails: count, log at a bounded rate, back off.

Every network call of the tier catches what ``Faults.expected`` accepts. A fault (lost
connection, timeout, refused write, cluster reconfiguring) never reaches the
caller: the call answers a miss or drops the write. After a connection-level
fault the tier stops touching the network for ``retry_after_s`` (a hung
server would otherwise cost every engine step a full timeout), then tries
again; redis-py's pool reconnects on that next command.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.exceptions import RedisClusterException

from lmkv.backend import TierCounters
from lmkv.logutil import RateLimitedLog
from lmkv.redact import Redactor

logger = logging.getLogger(__name__)

#: Everything a Redis call can fail with at run time.
FAULTS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
#: Faults that say the server (or the route to it) is gone, not just this command.
CONNECTION_FAULTS: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
    RedisClusterException, OSError)


class Faults:
    def __init__(self, counters: TierCounters, where: str, retry_after_s: float,
                 redact: Redactor | None = None) -> None:
        self.counters = counters
        self.redact = redact or Redactor()
        self.where = where
        self.retry_after_s = retry_after_s
        self._log = RateLimitedLog(logger)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.closed = False

    def expected(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a fault to absorb: a Redis or network error, or
        anything at all once the tier is closed (closing pulls the sockets from
        under calls in flight, and redis-py then fails in assorted ways)."""
        return self.closed or isinstance(exc, FAULTS)

    @property
    def down(self) -> bool:
        """True while the tier is backing off after a connection fault."""
        return time.monotonic() < self._down_until

    def record(self, what: str, exc: BaseException, consequence: str) -> None:
        """Count and log one failed operation (``consequence``: what the caller got)."""
        if self.closed:
            return
        self.counters.errors += 1
        if isinstance(exc, CONNECTION_FAULTS):
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
        self._log.warning(f"{what}:{type(exc).__name__}",
                          "lmkv redis tier (%s): %s failed (%s: %s); %s",
                          self.where, what, type(exc).__name__, self.redact(exc),
                          consequence)

    def note(self, key: str, msg: str, *args: object) -> None:
        """A rate-limited warning about data (a missing part, a corrupt entry)."""
        self._log.warning(key, "lmkv redis tier (%s): " + msg, self.where, *args)
