"""Which CPUs lmkv's own threads run on inside an engine that binds its threads.

vLLM's CPU build binds its OpenMP threads one per CPU of the set it gives a
rank (``VLLM_CPU_OMP_THREADS_BIND``), the main thread included: the main
thread may then run on one CPU only, and every thread it starts inherits that
one CPU. lmkv's threads (lookups, prefetch, disk reads and writes, stores)
would all share the CPU of vLLM's forward while the rank's other CPUs sit idle
between parallel regions.

``engine_cpus()`` is the union of the CPUs every thread of this process may
run on: the rank's set (the OpenMP threads cover it), never more than the
process was given. The vLLM worker ``share``s it once, before it starts lmkv's
threads; each lmkv thread calls ``apply()`` when it starts, which widens that
thread (only) to the shared set. Nothing is shared outside such an engine, so
``apply`` does nothing there.

Threads that only store (write-through to lower tiers, disk writes, lazy
stores) start with ``apply_background()``: the same CPUs at a lower priority
(``BACKGROUND_NICE``), everywhere. A store that runs while a request loads its
prefix or the forward runs then takes the CPU only when they leave it: on a
host with few CPUs, a background write of the previous request's KV otherwise
preempts the next request's load (a load from disk measured twice as long in a
fresh vLLM process right after it stored new prompts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_shared: frozenset[int] | None = None


def engine_cpus() -> frozenset[int] | None:
    """The union of the CPU affinities of this process's threads; None where the
    platform cannot say."""
    cpus: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError), \
                open(f"/proc/self/task/{tid}/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    cpus |= _parse_list(line.split(":", 1)[1])
                    break
    return frozenset(cpus) or None


def share(cpus: frozenset[int] | None) -> None:
    """The CPUs lmkv's threads started from now on run on (None: as they inherit)."""
    global _shared
    _shared = cpus
    if cpus is not None and hasattr(os, "sched_getaffinity"):
        mine = os.sched_getaffinity(0)
        if set(mine) != set(cpus):
            logger.info("lmkv: this thread runs on CPUs %s; lmkv's threads run on %s",
                        _format(mine), _format(cpus))


def shared() -> frozenset[int] | None:
    """The CPUs ``share`` named (None: none shared)."""
    return _shared


def apply() -> None:
    """Run the calling thread on the shared CPUs at the process's priority (a
    thread initializer)."""
    _set_nice(lambda base: base)  # started by a storing thread: not its priority
    cpus = _shared
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError, ValueError):  # CPUs gone offline, say: as inherited
        os.sched_setaffinity(0, cpus)


#: How much lower than the process the storing threads run (``nice`` steps; the
#: kernel gives a thread at +10 about a tenth of a contended CPU).
BACKGROUND_NICE = 10


def apply_background() -> None:
    """``apply``, and run the calling thread at ``BACKGROUND_NICE`` below the
    process (a thread initializer for threads whose work waits: stores)."""
    apply()
    lower_priority(BACKGROUND_NICE)


def lower_priority(steps: int) -> None:
    """Run the calling thread ``steps`` nice levels below the process's main
    thread (Linux: per thread; elsewhere, or where the system refuses, nothing
    changes). Never raises."""
    _set_nice(lambda base: min(19, base + steps))


def _set_nice(target: Callable[[int], int]) -> None:
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        want = target(os.getpriority(os.PRIO_PROCESS, os.getpid()))  # the main thread's
        if os.getpriority(os.PRIO_PROCESS, tid) != want:
            os.setpriority(os.PRIO_PROCESS, tid, want)


def _parse_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if m:
            first = int(m.group(1))
            out.update(range(first, int(m.group(2) or first) + 1))
    return out


def _format(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
