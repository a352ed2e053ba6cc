"""The ``fs`` tier on local disk.

Run as a script, this module is the other process of the sharing and fault
tests: ``python tests/backends/test_fs.py ROLE URL [ENDPOINT]`` (see ``main``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, tensor_obj
from lmkv.plugins import PluginManager, hookimpl
from lmkv.storage.manager import chain_parents
from lmkv.testing import StorageBackendConformance
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.tiers import fs_local
from lmkv_backends.tiers.fs import FSBackend
from lmkv_backends.tiers.fs_index import EntryIndex, entry_name
from lmkv_backends.tiers.fs_local import TMP_PREFIX
from lmkv_policies.lru import LRUPolicy

SHAPE = (2, 2, 16, 2, 32)
DTYPE = torch.float16
# A model name with what a file name cannot carry as it is.
META = KeyMeta("org/Model v1:ü%..", 1, 0, "float16", "l2thd")
FRAME_BYTES = len(NaiveSerializer().frame_bytes(tensor_obj(torch.zeros(SHAPE, dtype=DTYPE)),
                                                CacheKey(META, bytes(32))))
HERE = Path(__file__).resolve()
TIMEOUT = 30


def key(i: int) -> CacheKey:
    return CacheKey(META, i.to_bytes(32, "little"))


def chunk(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(DTYPE)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_fs(url: str, arena: MemoryAllocator, **options: object) -> FSBackend:
    context = BackendContext(serializer=NaiveSerializer(), eviction_policy=LRUPolicy(),
                             allocate=arena.allocate)
    return FSBackend(FSBackend.Options(url=url, **options), context)


def put(backend: FSBackend, ids: list[int]) -> int:
    objs = [tensor_obj(chunk(i)) for i in ids]
    return backend.batched_submit_put([key(i) for i in ids], objs).result(timeout=TIMEOUT)


def read(backend: FSBackend, i: int) -> torch.Tensor | None:
    obj = backend.get_blocking(key(i))
    if obj is None:
        return None
    try:
        return obj.tensor.clone()
    finally:
        obj.ref_down()


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(".lmkv"))


@pytest.fixture
def arena() -> Iterator[MemoryAllocator]:
    arena = MemoryAllocator(16 << 20)
    yield arena
    assert arena.live_objects == 0, "a chunk buffer was leaked"


@pytest.fixture
def make(tmp_path: Path, arena: MemoryAllocator) -> Iterator[Callable[..., FSBackend]]:
    """``make(**options)``: an fs tier on ``tmp_path`` (closed after the test)."""
    made: list[FSBackend] = []

    def factory(url: str | None = None, **options: object) -> FSBackend:
        backend = make_fs(url or str(tmp_path), arena, **options)
        made.append(backend)
        return backend

    yield factory
    for backend in made:
        backend.close()


class TestLocalConformance(StorageBackendConformance):
    backend_class = FSBackend

    @pytest.fixture(autouse=True)
    def _setup(self, tmp_path: Path, arena: MemoryAllocator) -> None:
        self.root = tmp_path
        self.arena = arena

    def backend_options(self) -> dict[str, object]:
        return {"url": f"file://{self.root}", "durable": False}

    def make_backend(self) -> FSBackend:
        return make_fs(f"file://{self.root}", self.arena, durable=False)

    def make_bounded_backend(self, max_bytes: int) -> FSBackend:
        return make_fs(f"file://{self.root}", self.arena, durable=False, max_bytes=max_bytes)

    def corrupt_entry(self, backend: FSBackend, key: CacheKey) -> bool:
        path = self.root / entry_name(key)
        path.write_bytes(CORRUPTIONS["payload bit flip"](path.read_bytes()))
        return True

    def copy_entry(self, backend: FSBackend, source: CacheKey, target: CacheKey) -> bool:
        (self.root / entry_name(target)).write_bytes((self.root / entry_name(source)).read_bytes())
        return True

    @contextmanager
    def make_unreachable(self, backend: FSBackend) -> Iterator[None]:
        """The directory moved away and a file in its place: every access fails
        with an OSError (ENOTDIR), as on a disk that went away; then put back."""
        away = self.root.with_name(self.root.name + ".away")
        self.root.rename(away)
        self.root.write_bytes(b"")
        try:
            yield
        finally:
            self.root.unlink()
            away.rename(self.root)


# -- restart, atomicity, durability ------------------------------------------------

def test_entries_survive_a_restart(make: Callable[..., FSBackend], tmp_path: Path) -> None:
    first = make()
    assert put(first, [0, 1, 2]) == 3
    usage = first.usage_bytes
    first.close()
    # the key (with its escaped model name) comes back from the file name
    assert [p.parent for p in entry_files(tmp_path)] == [tmp_path] * 3
    second = make()
    assert second.usage_bytes == usage == 3 * FRAME_BYTES
    assert second.batched_async_contains("l", [key(0), key(1), key(2), key(3)]) == 3
    for i in range(3):
        assert torch.equal(read(second, i), chunk(i))


@pytest.mark.slow  # a worker process
def test_a_crash_mid_write_leaves_no_entry_and_the_temporary_is_cleaned(
        make: Callable[..., FSBackend], tmp_path: Path) -> None:
    run_worker("crash", str(tmp_path), check=False)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert leftovers and not entry_files(tmp_path)  # the writer died between write and rename
    stranger = tmp_path / f"{TMP_PREFIX}otherhost.123.abc"  # another host's, in flight
    stranger.write_bytes(b"partial")
    ancient = tmp_path / f"{TMP_PREFIX}otherhost.456.def"
    ancient.write_bytes(b"partial")
    os.utime(ancient, (time.time() - 7200, time.time() - 7200))
    backend = make()
    assert not backend.contains(key(0))
    assert read(backend, 0) is None
    remaining = {p.name for p in tmp_path.iterdir()}
    assert remaining == {stranger.name}
    assert backend.usage_bytes == 0


def test_what_a_put_flushes_before_the_rename(make: Callable[..., FSBackend],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Durable: data, name, then the directory. Not durable (the default): the
    rename only. ``page_cache`` off: each segment's writeback started, the data
    flushed, then its pages handed back, before the rename."""
    calls: list[str] = []
    for name in ("fdatasync", "fsync", "rename", "posix_fadvise"):
        real = getattr(os, name)

        def spy(*args: object, _real: Callable = real, _name: str = name) -> object:
            if _name != "posix_fadvise":
                calls.append(_name)
            elif args[3] == os.POSIX_FADV_DONTNEED:
                calls.append("dontneed")
            return _real(*args)

        monkeypatch.setattr(os, name, spy)
    durable = make(io_threads=1, durable=True)
    put(durable, [0, 1])
    assert calls == ["fdatasync", "rename"] * 2 + ["fsync"]  # data, name, then the directory
    calls.clear()
    put(make(durable=False), [2])
    assert calls == ["rename"]
    calls.clear()
    put(make(), [3])  # the default: in the page cache, written back by the OS
    assert calls == ["rename"]
    calls.clear()
    monkeypatch.setattr(fs_local, "WRITE_SEGMENT", FRAME_BYTES // 3)
    put(make(page_cache=False), [4])  # its pages go only once clean: flushed first
    segments = calls.index("fdatasync")
    assert segments >= 3 and calls[:segments] == ["dontneed"] * segments
    assert calls[segments:] == ["fdatasync", "dontneed", "rename"]


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
@pytest.mark.parametrize("page_cache", [False, True])
def test_entries_leave_the_page_cache_unless_asked(page_cache: bool, tmp_path: Path,
                                                   make: Callable[..., FSBackend]) -> None:
    def cached_bytes() -> int:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                              str(tmp_path / entry_name(key(1)))],
                             capture_output=True, text=True, check=True).stdout
        return int(out.strip())

    backend = make(page_cache=page_cache)
    put(backend, [1])
    assert (cached_bytes() > 0) == page_cache
    assert torch.equal(read(backend, 1), chunk(1))
    assert (cached_bytes() > 0) == page_cache


def advice_given(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``posix_fadvise`` advice the tier gives from now on, in order."""
    calls: list[int] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(advice)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return calls


def test_the_page_cache_is_kept_by_default(make: Callable[..., FSBackend],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process reads what another stored from the page cache (the default
    was chosen from ``bench_fs.py --cross-process`` and ``bench_vllm.py``)."""
    advice = advice_given(monkeypatch)
    backend = make()
    assert backend.options.page_cache is True
    put(backend, [1])
    assert torch.equal(read(backend, 1), chunk(1))
    assert os.POSIX_FADV_SEQUENTIAL in advice  # the spy sees the tier's advice
    assert os.POSIX_FADV_DONTNEED not in advice


@pytest.mark.parametrize("page_cache", [False, True])
def test_both_page_cache_settings_read_back_in_a_fresh_tier(
        page_cache: bool, make: Callable[..., FSBackend],
        monkeypatch: pytest.MonkeyPatch) -> None:
    advice = advice_given(monkeypatch)
    writer = make(page_cache=page_cache)
    assert put(writer, [1, 2]) == 2
    writer.close()
    assert (os.POSIX_FADV_DONTNEED in advice) is not page_cache  # after each write
    advice.clear()
    reader = make(page_cache=page_cache)  # a restart: the index comes from the directory
    assert reader.batched_async_contains("l", [key(1), key(2), key(3)]) == 2
    for i in (1, 2):
        assert torch.equal(read(reader, i), chunk(i))
    assert (os.POSIX_FADV_DONTNEED in advice) is not page_cache  # after each read


def test_a_durable_write_keeping_the_page_cache_starts_writeback_early(
        make: Callable[..., FSBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping pages, each segment still goes to the disk as soon as it is written
    (``sync_file_range``), not all of it at the final fdatasync."""
    started: list[tuple[int, int]] = []

    def spy(fd: int, offset: int, length: int, flags: int) -> int:
        started.append((offset, length))
        return 0

    monkeypatch.setattr(fs_local, "_sync_file_range", spy)
    monkeypatch.setattr(fs_local, "WRITE_SEGMENT", FRAME_BYTES // 3)
    put(make(page_cache=True, durable=True), [1])
    assert started and started[0][0] == 0
    assert sum(length for _, length in started) == FRAME_BYTES
    started.clear()
    put(make(page_cache=True, durable=False), [2])
    assert started == []  # not durable: the OS writes it back when it likes


def test_a_large_entry_is_written_in_pieces_of_at_most_a_mib(
        make: Callable[..., FSBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of several MiB in one call makes the kernel give the file new large
    folios, at many times the CPU of the same bytes in pieces (docs/benchmarks.md):
    every pwritev of an entry carries at most 1 MiB, and together all of it."""
    calls: list[int] = []
    real = os.pwritev

    def spy(fd: int, buffers: list, offset: int, *flags: int) -> int:
        calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(fs_local.os, "pwritev", spy)
    backend = make()
    big = torch.randn(3 << 18)  # 3 MiB of float32: more than two pieces
    assert backend.batched_submit_put([key(7)], [tensor_obj(big)]).result(TIMEOUT) == 1
    assert max(calls) <= 1 << 20 and len(calls) >= 3
    assert sum(calls) == backend.store.stat(entry_name(key(7)))
    got = backend.get_blocking(key(7))
    assert got is not None
    try:
        assert torch.equal(got.tensor, big)
    finally:
        got.ref_down()


def test_another_process_writing_the_directory_is_seen(make: Callable[..., FSBackend]) -> None:
    reader = make()  # started before the writer stores anything
    writer = make()
    put(writer, [5, 6])
    assert reader.batched_async_contains("l", [key(5), key(6)], pin=True) == 2
    assert torch.equal(read(reader, 6), chunk(6))
    assert reader.usage_bytes == 2 * FRAME_BYTES
    # and removals by the other one are a miss, not an error
    assert writer.remove(key(5))
    assert read(reader, 5) is None
    assert reader.stats()["errors"] == 0
    reader.unpin(key(6))


def test_a_key_too_long_for_a_file_name_is_a_counted_dropped_write(
        make: Callable[..., FSBackend]) -> None:
    backend = make()
    long_key = CacheKey(KeyMeta("m" * 300), bytes(32))
    stored = backend.batched_submit_put([long_key], [tensor_obj(chunk(0))]).result(TIMEOUT)
    assert stored == 0
    stats = backend.stats()
    assert (stats["dropped_writes"], stats["errors"], stats["usage_bytes"]) == (1, 1, 0)
    assert not backend.contains(long_key) and backend.get_blocking(long_key) is None


def test_foreign_files_are_left_alone(make: Callable[..., FSBackend], tmp_path: Path) -> None:
    (tmp_path / "README").write_text("not ours")
    (tmp_path / "junk.lmkv").write_bytes(b"not a key")
    backend = make()
    assert put(backend, [1]) == 1
    assert backend.usage_bytes == FRAME_BYTES
    assert (tmp_path / "README").exists() and (tmp_path / "junk.lmkv").exists()


# -- capacity and eviction ---------------------------------------------------------

def test_budget_evicts_least_recently_used_and_never_pinned(
        make: Callable[..., FSBackend], tmp_path: Path) -> None:
    backend = make(max_bytes=4 * FRAME_BYTES)
    assert put(backend, [0, 1, 2, 3]) == 4
    assert read(backend, 0) is not None  # 0 becomes the most recent
    assert backend.pin(key(1))  # 1 is the least recent, but pinned
    assert put(backend, [4, 5]) == 2
    assert [backend.contains(key(i)) for i in range(6)] == [True, True, False, False, True,
                                                            True]
    assert len(entry_files(tmp_path)) == 4
    assert backend.usage_bytes == 4 * FRAME_BYTES
    assert backend.stats()["evictions"] == 2
    # everything pinned: a put is refused, counted, and nothing is evicted
    for i in (0, 4, 5):
        backend.pin(key(i))
    assert put(backend, [6]) == 0
    assert backend.stats()["dropped_writes"] == 1
    assert all(backend.contains(key(i)) for i in (0, 1, 4, 5))
    for i in (0, 1, 4, 5):
        assert backend.unpin(key(i))


def test_eviction_never_orphans_a_prefix(make: Callable[..., FSBackend]) -> None:
    """A 4-chunk prompt in a 4-chunk fs tier, read head first, plus one more store:
    the prompt's tail goes, chunks 0-2 stay (the issue's orphan scenario)."""
    backend = make(max_bytes=4 * FRAME_BYTES, io_threads=1)
    keys = [key(i) for i in range(4)]
    objs = [tensor_obj(chunk(i)) for i in range(4)]
    assert backend.batched_submit_put(keys, objs, chain_parents(keys)).result(TIMEOUT) == 4
    for i in range(4):
        assert read(backend, i) is not None
    assert put(backend, [9]) == 1
    assert [backend.contains(k) for k in keys] == [True, True, True, False]
    assert backend.batched_async_contains("x", keys) == 3


def test_a_write_evicts_in_passes_tail_then_head() -> None:
    """Leaves only are candidates: a write that needs more room than the leaves
    hold evicts a tail, then the chunk before it, until it fits; when even all
    of it is not enough, nothing changes."""
    index = EntryIndex(LRUPolicy(), capacity=40)
    keys = [key(i) for i in range(4)]
    for i, k in enumerate(keys):
        index.commit(k, 0, 10, keys[i - 1] if i else None)
    evicted = index.reserve(25)
    assert evicted == [(keys[3], 10), (keys[2], 10), (keys[1], 10)]
    assert index.usage == 10 and index.reserved == 25
    index.release(25)
    for i in (1, 2, 3):
        index.commit(keys[i], 0, 10, keys[i - 1])
    index.lookup(keys[1], pin=True)  # 0 and 1 cannot go: 20 bytes at most
    assert index.reserve(25) is None
    assert [index.lookup(k) for k in keys] == [True, True, True, True]
    assert index.usage == 40 and index.reserved == 0
    assert index.candidates() == [keys[3]]  # the lineage is back
    index.unpin(keys[1])
    assert index.excess_victims() == []
    index.capacity = 15
    assert [k for k, _ in index.excess_victims()] == [keys[3], keys[2], keys[1]]


def test_parallel_puts_never_exceed_the_budget(make: Callable[..., FSBackend],
                                               tmp_path: Path) -> None:
    budget = 5 * FRAME_BYTES
    backend = make(max_bytes=budget, io_threads=4, durable=False)
    assert put(backend, list(range(40))) == 40
    sizes = [p.stat().st_size for p in entry_files(tmp_path)]
    assert sum(sizes) == backend.usage_bytes <= budget
    assert len(sizes) == 5


def test_a_smaller_budget_after_a_restart_evicts_the_oldest(make: Callable[..., FSBackend]
                                                            ) -> None:
    first = make(durable=False)
    for i in range(4):
        put(first, [i])
        time.sleep(0.01)  # distinct modification times order the entries
    first.close()
    second = make(max_bytes=2 * FRAME_BYTES)
    assert [second.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert second.usage_bytes == 2 * FRAME_BYTES


def test_an_entry_larger_than_the_budget_is_dropped_and_counted(
        make: Callable[..., FSBackend], tmp_path: Path) -> None:
    backend = make(max_bytes=FRAME_BYTES - 1)
    assert put(backend, [1]) == 0
    stats = backend.stats()
    assert stats["dropped_writes"] == 1 and stats["usage_bytes"] == 0
    assert not list(tmp_path.iterdir())


def test_put_remove_cycles_leave_usage_where_it_started(make: Callable[..., FSBackend],
                                                        tmp_path: Path) -> None:
    backend = make(durable=False, max_bytes=8 * FRAME_BYTES)
    put(backend, [10**6])
    start = backend.usage_bytes
    for cycle in range(1000):
        ids = [3 * cycle, 3 * cycle + 1, 3 * cycle + 2]
        assert put(backend, ids) == 3
        for i in ids:
            assert backend.remove(key(i))
    assert backend.usage_bytes == start == FRAME_BYTES
    assert len(entry_files(tmp_path)) == 1
    assert backend.stats()["evictions"] == 0


# -- faults --------------------------------------------------------------------------

CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "payload bit flip": lambda b: b[:-100] + bytes([b[-100] ^ 0x01]) + b[-99:],
    "header bit flip": lambda b: b[:20] + bytes([b[20] ^ 0x80]) + b[21:],
    "truncated": lambda b: b[: len(b) // 2],
    "foreign file": lambda b: os.urandom(len(b)),
    "empty": lambda b: b"",
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
@pytest.mark.parametrize("serializer_reads_raw", [True, False])
def test_a_corrupted_entry_is_a_removed_miss(corrupt: str, serializer_reads_raw: bool,
                                             make: Callable[..., FSBackend], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NaiveSerializer, "raw_payload", serializer_reads_raw)
    backend = make()
    put(backend, [1, 2])
    path = tmp_path / entry_name(key(1))
    path.write_bytes(CORRUPTIONS[corrupt](path.read_bytes()))
    assert backend.contains(key(1))  # nothing has read it yet
    assert read(backend, 1) is None
    stats = backend.stats()
    assert (stats["corrupt_frames"], stats["misses"], stats["hits"]) == (1, 1, 0)
    assert not path.exists() and not backend.contains(key(1))
    assert backend.usage_bytes == FRAME_BYTES
    assert torch.equal(read(backend, 2), chunk(2))


def test_a_frame_of_another_serializer_is_a_miss(make: Callable[..., FSBackend],
                                                 tmp_path: Path) -> None:
    class Other(NaiveSerializer):
        serializer_id = 150

    backend = make()
    path = tmp_path / entry_name(key(3))
    path.write_bytes(Other().frame_bytes(tensor_obj(chunk(3)), key(3)))
    assert read(backend, 3) is None
    assert backend.stats()["corrupt_frames"] == 1 and not path.exists()


@pytest.mark.slow  # a worker process
def test_a_filesystem_that_refuses_writes(tmp_path: Path) -> None:
    """Writes past RLIMIT_FSIZE fail with EFBIG (SIGXFSZ ignored): counted, no entry,
    no temporary left; existing entries stay readable."""
    arena = MemoryAllocator(1 << 20)
    backend = make_fs(str(tmp_path), arena)
    put(backend, [1])
    backend.close()
    out = run_worker("refused", str(tmp_path))
    assert out["stored"] == 0
    assert out["dropped_writes"] == out["errors"] == 2
    assert out["read_back"] == digest(chunk(1))
    assert [p.name for p in tmp_path.iterdir()] == [entry_name(key(1))]


def test_close_waits_for_puts_in_flight(make: Callable[..., FSBackend]) -> None:
    backend = make(io_threads=1)
    future = backend.batched_submit_put([key(i) for i in range(10)],
                                        [tensor_obj(chunk(i)) for i in range(10)])
    backend.close()
    assert future.done() and future.result() == 10
    assert make().usage_bytes == 10 * FRAME_BYTES


def test_close_past_its_timeout_drops_queued_puts_and_releases_them(
        make: Callable[..., FSBackend], arena: MemoryAllocator) -> None:
    backend = make(io_threads=1, close_timeout_s=0)
    gate = threading.Event()
    write = backend.store.write

    def held_write(*args: object) -> int:
        gate.wait(TIMEOUT)  # the first write stays in flight until the test lets it go
        return write(*args)

    backend.store.write = held_write
    objs = []
    for i in range(30):
        obj = arena.allocate(SHAPE, DTYPE)
        obj.tensor.copy_(chunk(i))
        objs.append(obj)
    future = backend.batched_submit_put([key(i) for i in range(30)], objs)
    for obj in objs:
        obj.ref_down()  # the tier holds its own references
    backend.close()
    gate.set()
    assert future.result(timeout=TIMEOUT) == 1
    assert backend.stats()["dropped_writes"] == 29
    assert arena.live_objects == 0


def test_operations_after_close_are_misses(make: Callable[..., FSBackend]) -> None:
    backend = make()
    put(backend, [1])
    backend.close()
    assert put(backend, [2]) == 0
    assert read(backend, 1) is None
    assert backend.batched_get_non_blocking("l", [key(1)]).result(timeout=TIMEOUT) == []


# -- sharing between processes, config ---------------------------------------------------

@pytest.mark.slow  # worker processes
def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    check_sharing(str(tmp_path))


def check_sharing(url: str, endpoint: str = "") -> None:
    """A reader process starts first; a writer process stores; the reader then finds
    and retrieves the KV byte-identical (through its own cpu + fs tiers)."""
    reader = subprocess.Popen([sys.executable, str(HERE), "read", url, endpoint],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
        written = run_worker("write", url, endpoint)
        out, _ = reader.communicate("go\n", timeout=120)
    finally:
        reader.kill()
    got = json.loads(out.strip().splitlines()[-1])
    assert got["hits"] == SHARED_CHUNKS
    assert got["digests"] == written["digests"] == [digest(chunk(i))
                                                    for i in range(SHARED_CHUNKS)]


def test_config_selects_the_fs_tier(lmkv_plugin_manager: PluginManager,
                                    register_lmkv_plugin: Callable[..., str],
                                    tmp_path: Path) -> None:
    from lmkv import StorageManager, load_config

    class Plugin:
        @hookimpl
        def lmkv_storage_backends(self) -> list[type]:
            return [FSBackend]

    if "fs" not in lmkv_plugin_manager.registry.names("storage_backend"):
        register_lmkv_plugin(Plugin())  # until lmkv_backends.plugin registers it
    assert lmkv_plugin_manager.storage_backend("fs") is FSBackend
    config = load_config(env={}, overrides={
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "1MiB"}},
                       {"type": "fs", "options": {"url": str(tmp_path), "max_bytes": "1MiB"}}],
    })
    manager = StorageManager.from_config(config)
    try:
        fs_tier = manager.tiers[1]
        assert isinstance(fs_tier, FSBackend) and fs_tier.capacity_bytes == 1 << 20
        obj = manager.allocate(SHAPE, DTYPE)
        obj.tensor.copy_(chunk(7))
        manager.put([key(7)], [obj])
        obj.ref_down()
        assert manager.flush()
        assert fs_tier.contains(key(7)) and (tmp_path / entry_name(key(7))).exists()
    finally:
        manager.close()
    shown = json.dumps(load_config(env={}, overrides={
        "lmkv.tiers": [{"type": "cpu"}, {"type": "fs", "options": {
            "url": "s3://b/p", "key": "AKIDSECRETID", "secret": "hunter22",
            "storage_options": {"client_kwargs": {"aws_session_token": "tok3n"}}}}],
    }).resolved_dump())  # what `lmkv config check` prints
    assert "hunter22" not in shown and "AKIDSECRETID" not in shown and "tok3n" not in shown
    with pytest.raises(ConfigError, match=r"tiers\.1\.options\.colour"):
        load_config(env={}, overrides={
            "lmkv.tiers": [{"type": "cpu"}, {"type": "fs", "options": {"url": "/x",
                                                                        "colour": 1}}]})


def test_secrets_never_show(tmp_path: Path, arena: MemoryAllocator) -> None:
    options = FSBackend.Options(url="s3://bucket/p", key="AKIDSECRETID", secret="hunter22",
                                storage_options={"token": "tok3n", "anon": False})
    text = repr(options) + options.model_dump_json()
    assert "hunter22" not in text and "AKIDSECRETID" not in text and "tok3n" not in text
    with pytest.raises(ConfigError) as info:  # what config check says, too
        load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "fs", "options": {"url": f"file://{tmp_path}", "key": "AKIDSECRETID"}}]})
    assert "AKIDSECRETID" not in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("config key 'tiers.0.options'")
    assert "key applies to s3:// URLs only" in str(info.value)


# -- the other process ------------------------------------------------------------------

SHARED_CHUNKS = 4


def run_worker(role: str, url: str, endpoint: str = "", check: bool = True) -> dict:
    proc = subprocess.run([sys.executable, str(HERE), role, url, endpoint],
                          capture_output=True, text=True, timeout=120)
    if not check:
        return {}
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker_tiers(url: str, endpoint: str) -> tuple[object, FSBackend]:
    from lmkv import StorageManager
    from lmkv_backends.tiers.cpu import CPUBackend

    cpu = CPUBackend(CPUBackend.Options(max_bytes=4 << 20),
                     BackendContext(eviction_policy=LRUPolicy()))
    options: dict[str, object] = {"url": url}
    if endpoint:
        options.update(endpoint_url=endpoint, key="testing", secret="testing")
    fs = FSBackend(FSBackend.Options(**options),
                   BackendContext(serializer=NaiveSerializer(), eviction_policy=LRUPolicy(),
                                  allocate=cpu.allocate, tier_index=1))
    return StorageManager([cpu, fs]), fs


def main(role: str, url: str, endpoint: str = "") -> None:
    keys = [key(i) for i in range(SHARED_CHUNKS)]
    if role == "crash":  # die between writing the temporary and renaming it
        os.rename = lambda *_: os._exit(3)
        put(make_fs(url, MemoryAllocator(1 << 20)), [0])
    elif role == "refused":
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        backend = make_fs(url, MemoryAllocator(1 << 20))
        stored = put(backend, [2, 3])
        got = read(backend, 1)
        print(json.dumps({"stored": stored, **backend.stats(),
                          "read_back": digest(got) if got is not None else None}))
    elif role == "write":
        manager, _ = _worker_tiers(url, endpoint)
        objs = [manager.allocate(SHAPE, DTYPE) for _ in keys]
        for i, obj in enumerate(objs):
            obj.tensor.copy_(chunk(i))
        manager.put(keys, objs).result(timeout=TIMEOUT)
        for obj in objs:
            obj.ref_down()
        assert manager.flush(TIMEOUT)
        print(json.dumps({"digests": [digest(chunk(i)) for i in range(SHARED_CHUNKS)]}))
        manager.close()
    elif role == "read":
        manager, fs = _worker_tiers(url, endpoint)
        print("ready", flush=True)
        sys.stdin.readline()
        hits = manager.contains_prefix(keys)
        objs = manager.get(keys)
        print(json.dumps({"hits": hits, "digests": [digest(o.tensor) for o in objs],
                          "fs": fs.stats()}))
        for obj in objs:
            obj.ref_down()
        manager.close()


if __name__ == "__main__":
    main(*sys.argv[1:])


def test_a_bug_in_the_read_path_is_no_tier_fault_and_never_stops_the_engine(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tier absorbs only its declared faults (I/O errors): a bug raises out of
    it uncounted; the storage manager's last resort logs it at ERROR and misses."""
    from lmkv.storage.manager import StorageManager

    arena = MemoryAllocator(1 << 22)
    backend = make_fs(str(tmp_path), arena)
    assert put(backend, [0, 1]) == 2

    def buggy(*args: object) -> object:
        raise TypeError("a bug in the read path")

    backend.store.read_into = buggy  # type: ignore[method-assign]
    backend.store.read_frame = buggy  # type: ignore[method-assign]
    with pytest.raises(TypeError):
        backend.get_blocking(key(0))
    assert backend.counters.errors == 0

    manager = StorageManager([backend])
    with caplog.at_level(logging.WARNING):
        assert manager.get([key(0), key(1)]) == []
    assert backend.counters.errors == 0
    bugs = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert bugs and "a bug in the tier" in bugs[0].getMessage()
    assert "TypeError: a bug in the read path" in bugs[0].getMessage()
    assert arena.used_bytes == 0  # nothing the failed batch read is kept
    manager.close()


def test_an_io_error_in_the_read_path_is_a_counted_miss(tmp_path: Path) -> None:
    arena = MemoryAllocator(1 << 22)
    backend = make_fs(str(tmp_path), arena)
    assert put(backend, [0]) == 1

    def failing(*args: object) -> object:
        raise PermissionError("denied")

    backend.store.read_into = failing  # type: ignore[method-assign]
    backend.store.read_frame = failing  # type: ignore[method-assign]
    assert backend.get_blocking(key(0)) is None
    assert backend.counters.errors == 1 and backend.counters.misses == 1
    backend.close()
