"""Futures that combine the per-entry I/O of one batch without blocking a thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from lmkv.memory import MemoryObj

logger = logging.getLogger(__name__)


def outcome(future: Future, default: Any) -> Any:
    """The future's result, or ``default`` when it was cancelled or raised."""
    if future.cancelled() or future.exception() is not None:
        return default
    return future.result()


def gather(futures: Sequence[Future], combine: Callable[[list[Future]], Any],
           before_done: Callable[[], None] | None = None) -> Future:
    """A future of ``combine(futures)`` once all are done; ``before_done`` runs first
    (on the thread that finished last)."""
    out: Future = Future()
    if not futures:
        out.set_result(combine([]))
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            value = combine(list(futures))
            if before_done is not None:
                before_done()
        except BaseException as exc:
            logger.exception("lmkv fs tier: finishing a batch failed")
            out.set_exception(exc)
            return
        out.set_result(value)

    for future in futures:
        future.add_done_callback(one_done)
    return out


def count_true(futures: list[Future]) -> int:
    return sum(1 for f in futures if outcome(f, False))


def leading_objects(futures: list[Future]) -> list[MemoryObj]:
    """The objects up to the first miss; the ones after it are released."""
    objs: list[MemoryObj] = []
    missed = False
    for future in futures:
        obj = outcome(future, None)
        if obj is None:
            missed = True
        elif missed:
            obj.ref_down()
        else:
            objs.append(obj)
    return objs
