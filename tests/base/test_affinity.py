"""lmkv.base.affinity: lmkv's threads run on every CPU the process's threads cover,
not only on the one CPU an OpenMP runtime bound the starting thread to."""

from __future__ import annotations

import os
import threading

import pytest

from lmkv.base import affinity
from lmkv.base.affinity import _parse_list

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="CPU affinity is Linux's")


def test_cpu_lists_parse() -> None:
    assert _parse_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_list("5") == {5}
    assert _parse_list("") == set()


def test_a_thread_started_by_a_bound_thread_runs_on_the_engines_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to widen")
    seen: dict[str, object] = {}

    def bound() -> None:  # as vLLM's main thread is, once its OpenMP runtime bound it
        os.sched_setaffinity(0, {cpus[0]})
        seen["union"] = affinity.engine_cpus()

        def started(name: str) -> None:
            affinity.apply()
            seen[name] = os.sched_getaffinity(0)

        child = threading.Thread(target=started, args=("inherited",))
        child.start()
        child.join()
        affinity.share(seen["union"])  # type: ignore[arg-type]
        try:
            child = threading.Thread(target=started, args=("widened",))
            child.start()
            child.join()
        finally:
            affinity.share(None)
        seen["self"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=bound)
    thread.start()
    thread.join()
    assert seen["union"] == frozenset(cpus)  # the other threads still cover every CPU
    assert seen["inherited"] == {cpus[0]}  # nothing shared: as inherited
    assert seen["widened"] == set(cpus)
    assert seen["self"] == {cpus[0]}  # the bound thread itself is left alone
