"""Futures that combine the per-entry I/O of one batch without blocking a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from lmkv.memory import MemoryObj, release


def outcome(future: Future, default: Any) -> Any:
    """The future's result, or ``default`` when it was cancelled (closed). A job
    absorbs its own faults, so what one raised is a bug: it raises here."""
    if future.cancelled():
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
        except BaseException as exc:  # a bug: whoever takes the batch's result sees it
            out.set_exception(exc)
            return
        out.set_result(value)

    for future in futures:
        future.add_done_callback(one_done)
    return out


def release_outcome(future: Future) -> None:
    """Give back the chunk a job opened or read (a done-callback for jobs whose
    result nobody takes)."""
    if future.cancelled() or future.exception() is not None:
        return
    obj = future.result()
    if obj is not None:
        obj.ref_down()


def count_true(futures: list[Future]) -> int:
    return sum(1 for f in futures if outcome(f, False))


def leading_objects(futures: list[Future]) -> list[MemoryObj]:
    """The objects up to the first miss; the ones after it are released. A job
    that raised (a bug) raises here, once every object found is released."""
    objs: list[MemoryObj] = []
    missed = False
    error: BaseException | None = None
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            error = error or future.exception()
            missed = True
            continue
        obj = outcome(future, None)
        if obj is None:
            missed = True
        elif missed:
            obj.ref_down()
        else:
            objs.append(obj)
    if error is not None:
        release(objs)
        raise error
    return objs
