"""lmkv.base.affinity: lmkv's threads run on every CPU the process's threads cover,
not only on the one CPU an OpenMP runtime bound the starting thread to."""

from __future__ import annotations

import os
import threading

import pytest
import torch

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


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_storing_threads_run_below_the_process_and_what_they_start_does_not() -> None:
    """A storing thread yields the CPU to loads and the forward; a thread it happens
    to start for other work (a pool's first reader, say) runs at the process's
    priority again, not at the nice level it would inherit."""
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if base + affinity.BACKGROUND_NICE > 19:
        pytest.skip("this process runs at the lowest priority already")
    seen: dict[str, int] = {}

    def storing() -> None:
        affinity.apply_background()
        seen["storing"] = _nice()
        affinity.apply_background()  # twice: still one step below, not two
        seen["again"] = _nice()

        def started() -> None:
            affinity.apply()
            seen["started"] = _nice()

        child = threading.Thread(target=started)
        child.start()
        child.join()

    thread = threading.Thread(target=storing)
    thread.start()
    thread.join()
    assert seen["storing"] == seen["again"] == base + affinity.BACKGROUND_NICE
    assert _nice() == base  # the calling thread is left alone
    if os.geteuid() == 0:  # raising a priority back takes CAP_SYS_NICE
        assert seen["started"] == base
    else:
        assert seen["started"] in (base, base + affinity.BACKGROUND_NICE)


def test_the_storing_threads_of_the_storage_manager_and_the_fs_tier_run_below(tmp_path) -> None:
    from lmkv.contracts.tier import BackendContext
    from lmkv.storage.manager import StorageManager
    from lmkv_backends.serde.naive import NaiveSerializer
    from lmkv_backends.tiers.fs import FSBackend
    from lmkv_policies.lru import LRUPolicy
    from tests.storage.tiers import cpu, fill, key

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if base + affinity.BACKGROUND_NICE > 19:
        pytest.skip("this process runs at the lowest priority already")
    fs = FSBackend(FSBackend.Options(url=str(tmp_path)),
                   BackendContext(eviction_policy=LRUPolicy(), serializer=NaiveSerializer()))
    upper = cpu()
    manager = StorageManager([upper, fs])
    try:
        fill(upper, [1])
        obj = upper.get_blocking(key(1))
        assert obj is not None
        manager.put([key(2)], [obj], [None]).result()
        obj.ref_down()
        assert manager.flush(30)
        nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in threading.enumerate() if t.native_id is not None}
        writers = {n: v for n, v in nice.items() if n.startswith(("lmkv-write", "lmkv-fs-write"))}
        assert any(n.startswith("lmkv-write") for n in writers), nice
        assert any(n.startswith("lmkv-fs-write") for n in writers), nice
        assert set(writers.values()) == {base + affinity.BACKGROUND_NICE}, nice
    finally:
        manager.close()


def test_the_arena_prefault_thread_runs_below_the_process() -> None:
    """It starts with the first prefaulting arena, from whatever thread made it
    (in vLLM's worker, the forward's main thread): it must not keep that thread's
    priority."""
    import lmkv.memory as memory
    from lmkv.memory import MemoryAllocator

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if base + affinity.BACKGROUND_NICE > 19:
        pytest.skip("this process runs at the lowest priority already")
    if memory._MADVISE is None:
        pytest.skip("no libc madvise here")
    alloc = MemoryAllocator(16 << 20, pin_memory=False, prefault_ahead=4 << 20)
    obj = alloc.allocate((4096,), torch.uint8)
    assert alloc.prefaulter is not None and alloc.prefaulter.wait(30)
    obj.ref_down()
    (thread,) = [t for t in threading.enumerate() if t.name == "lmkv-arena-prefault"]
    assert thread.native_id is not None
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == base + affinity.BACKGROUND_NICE
