"""Futures finished when made, for answers known at once (a memory tier's get, a
lookup answered on the caller's thread): ``concurrent.futures.Future`` in every
respect, made without the Condition a pending one needs."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures._base import FINISHED
from typing import Any


class Finished(Future):
    """A future finished with ``value`` (``set_result`` and ``cancel`` then do what
    they do on any finished future: raise ``InvalidStateError``, return False)."""

    def __init__(self, value: Any) -> None:
        # Nothing waits on or is notified through a finished future's condition:
        # a lock serves (its own: ``concurrent.futures.wait`` takes several at once).
        self._condition = threading.RLock()  # type: ignore[assignment]
        self._state = FINISHED
        self._result = value
        self._exception = None
        self._waiters: list = []
        self._done_callbacks: list = []

    def result(self, timeout: float | None = None) -> Any:
        return self._result  # (finished with a value: never cancelled, never raised)
