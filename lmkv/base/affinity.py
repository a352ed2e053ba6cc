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
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

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


def apply() -> None:
    """Run the calling thread on the shared CPUs (a thread initializer)."""
    cpus = _shared
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError, ValueError):  # CPUs gone offline, say: as inherited
        os.sched_setaffinity(0, cpus)


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
