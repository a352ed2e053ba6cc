"""The lookup responders of this process, by the request endpoint each serves.

Where the scheduler and a worker share a process (vLLM's single-process
executor: one worker, scheduler and forward on one thread), the client hands
that worker's requests straight to its responder and takes the answer back
as a call: no message is encoded, and no thread is woken on either side. A
lookup the worker's memory tier answers whole is then answered before
``lookup`` returns. Requests to workers in other processes go over the
sockets as before; the answers, local or not, are checked the same way.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_responders: dict[str, weakref.ref[Any]] = {}


def register(endpoint: str, responder: Any) -> None:
    """``responder`` serves ``endpoint`` in this process (until ``unregister``)."""
    with _lock:
        _responders[endpoint] = weakref.ref(responder)


def unregister(endpoint: str, responder: Any) -> None:
    """``responder`` stops serving ``endpoint`` (another registered since is kept)."""
    with _lock:
        ref = _responders.get(endpoint)
        if ref is not None and ref() in (responder, None):
            del _responders[endpoint]


def _forget_all() -> None:
    """In a forked child: the parent's responders have no threads here."""
    global _lock
    _lock = threading.Lock()
    _responders.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)


def find(endpoint: str) -> Any | None:
    """The responder serving ``endpoint`` in this process, if one does."""
    ref = _responders.get(endpoint)  # (a dict read is atomic; no lock on the hot path)
    return ref() if ref is not None else None
