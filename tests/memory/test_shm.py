"""The shared-memory arena: the cpu tier's option and placement, the allocator's buffer,
attaching."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmkv.config.model import load_config
from lmkv.contracts.tier import ArenaPlacement, BackendContext
from lmkv.memory import MemoryAllocator
from lmkv.memory.shm import (
    HugePages,
    SharedMemoryUnavailable,
    SharedSegment,
    huge_pages,
    huge_segment_name,
)
from lmkv.server.main import build_storage, tiers_line
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy
from tests.server.procs import REPO, child_env, lmkv_segments

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def test_the_cpu_tier_places_its_arena_in_a_segment_and_unlinks_it_at_close() -> None:
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=True),
                      BackendContext(eviction_policy=LRUPolicy()))
    segment = tier.shared_segment
    assert segment is not None and segment.name in lmkv_segments()
    obj = tier.allocate((4, 64), torch.float32)
    obj.tensor.fill_(3.5)
    peer = SharedSegment.attach(segment.name)
    view = peer.tensor[obj.offset:obj.offset + obj.nbytes].view(torch.float32)
    assert torch.all(view == 3.5)  # another mapping sees the arena's bytes
    obj.ref_down()
    peer.close()
    tier.close()
    assert segment.name not in lmkv_segments()


def test_the_default_cpu_tier_has_no_segment() -> None:
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20),
                      BackendContext(eviction_policy=LRUPolicy()))
    assert tier.shared_segment is None
    tier.close()


def test_the_cpu_tier_honours_the_arena_placement_it_is_handed() -> None:
    shared = BackendContext(eviction_policy=LRUPolicy(), arena=ArenaPlacement.SHARED)
    tier = CPUBackend(CPUBackend.Options(max_bytes=1 << 20), shared)
    assert tier.shared_segment is not None and tier.shared_segment.name in lmkv_segments()
    tier.close()
    # the tier's own option wins over the placement, either way
    private = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=False), shared)
    assert private.shared_segment is None
    private.close()
    demanded = CPUBackend(CPUBackend.Options(max_bytes=1 << 20, shared_memory=True),
                          BackendContext(eviction_policy=LRUPolicy()))
    assert demanded.shared_segment is not None
    demanded.close()


def test_the_allocator_uses_a_given_buffer_and_checks_it() -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    alloc = MemoryAllocator(1 << 16, buffer=buffer)
    obj = alloc.allocate((16,), torch.uint8)
    obj.tensor.fill_(9)
    assert buffer[obj.offset:obj.offset + 16].eq(9).all()
    obj.ref_down()
    with pytest.raises(ValueError, match="at least"):
        MemoryAllocator(1 << 16, buffer=torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        MemoryAllocator(1024, buffer=torch.zeros(1024, dtype=torch.float32))


@pytest.mark.slow  # a process of its own
def test_a_process_that_attaches_and_exits_leaves_the_segment_alone() -> None:
    segment = SharedSegment.create(1 << 16)
    try:
        code = ("from lmkv.memory.shm import SharedSegment; "
                f"s = SharedSegment.attach({segment.name!r}); s.tensor[0] = 42; s.close()")
        subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), cwd=REPO,
                       timeout=60)
        assert segment.name in lmkv_segments()
        assert int(segment.tensor[0]) == 42
    finally:
        segment.close()
    assert segment.name not in lmkv_segments()


def test_attaching_a_missing_segment_is_unavailable() -> None:
    with pytest.raises(SharedMemoryUnavailable):
        SharedSegment.attach("lmkv-no-such-segment")


def test_a_segment_larger_than_dev_shm_is_refused_up_front() -> None:
    with pytest.raises(SharedMemoryUnavailable, match="free"):
        SharedSegment.create(1 << 60)


# -- huge pages ------------------------------------------------------------------

HUGE_PAGES_FOR_TESTS = 8  # 16 MiB of 2 MiB pages


@pytest.fixture
def reserved_huge_pages() -> Iterator[HugePages]:
    """Huge pages for one test: the host's free ones; else, where this process may
    (root, a writable /proc/sys), a few reserved for the test and handed back after;
    else the test is skipped, saying why."""
    pages = huge_pages()
    if pages is None:
        pytest.skip("this kernel reports no huge pages (not Linux)")
    if pages.available >= HUGE_PAGES_FOR_TESTS:
        yield pages
        return
    before = None
    try:
        before = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(f"{before + HUGE_PAGES_FOR_TESTS - max(pages.available, 0)}\n")
        pages = huge_pages()
        if pages is None or pages.available < HUGE_PAGES_FOR_TESTS:
            pytest.skip(f"the kernel did not reserve {HUGE_PAGES_FOR_TESTS} huge pages "
                        f"(memory too fragmented?)")
        yield pages
    except OSError as exc:
        pytest.skip(f"the host has no huge pages reserved and this process cannot reserve "
                    f"them ({exc.strerror or exc}): `sysctl vm.nr_hugepages=8` runs this test")
    finally:
        if before is not None:
            NR_HUGEPAGES.write_text(f"{before}\n")


def _shm_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmkv.memory.shm"]


@pytest.mark.slow  # processes of its own
def test_the_arena_goes_on_huge_pages_when_the_host_has_them_reserved(
        reserved_huge_pages: HugePages, caplog) -> None:
    caplog.set_level(logging.INFO, logger="lmkv.memory.shm")
    page = reserved_huge_pages.page_size
    segment = SharedSegment.create(3 * page - 100)
    try:
        assert segment.huge_pages and segment.page_size == page
        assert segment.size == 3 * page  # whole pages
        assert re.fullmatch(rf"/proc/{os.getpid()}/fd/\d+#lmkv-{os.getpid()}-[0-9a-f]+#\d+:\d+",
                            segment.name)
        assert segment.name in lmkv_segments() and not _shm_lines(caplog)
        assert huge_pages().available == reserved_huge_pages.available - 3  # taken now
        assert oct(os.stat(segment.name.partition("#")[0]).st_mode & 0o777) == oct(0o600)
        segment.tensor[-1] = 7
        # another process maps it by the name clients are handed, and writes into it
        code = ("import sys; from lmkv.memory.shm import SharedSegment; "
                "s = SharedSegment.attach(sys.argv[1], sys.argv[2]); assert s.huge_pages; "
                "assert int(s.tensor[-1]) == 7; s.tensor[0] = 42; s.close()")
        subprocess.run([sys.executable, "-c", code.replace("sys.argv[2]", "int(sys.argv[2])"),
                        segment.name, str(segment.size)], check=True, env=child_env(),
                       cwd=REPO, timeout=60)
        assert int(segment.tensor[0]) == 42
        # the cpu tier (what the lmkv server opens) places its arena there too
        tier = CPUBackend(CPUBackend.Options(max_bytes=page, shared_memory=True),
                          BackendContext(eviction_policy=LRUPolicy()))
        assert tier.shared_segment is not None and tier.shared_segment.huge_pages
        tier.close()
        # asking for more than is left falls back to /dev/shm with one line saying why
        left = huge_pages().available
        fallback = SharedSegment.create((left + 1) * page)
        assert not fallback.huge_pages and fallback.name in lmkv_segments()
        fallback.close()
        assert f"the arena needs {left + 1}" in fallback.no_huge_pages
        assert "sysctl vm.nr_hugepages=" in fallback.no_huge_pages
        assert not _shm_lines(caplog)  # said once, by the server's listening line
    finally:
        name = segment.name
        segment.close()
    assert huge_pages().available == reserved_huge_pages.available  # given back
    assert name not in lmkv_segments()
    with pytest.raises(SharedMemoryUnavailable):
        SharedSegment.attach(name)  # its creator closed it: nobody can map it any more


def test_without_enough_huge_pages_the_server_says_why_in_its_one_listening_line(
        monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("lmkv.memory.shm.huge_pages",
                        lambda: HugePages(page_size=2 << 20, total=3, available=1))
    config = load_config(env={}, overrides={"tiers": [{"type": "cpu",
                                                       "options": {"max_bytes": "8MiB"}}]})
    storage = build_storage(config)  # as the lmkv server opens its tiers
    try:
        segment = storage.tiers[0].shared_segment
        assert not segment.huge_pages and segment.name in lmkv_segments()
        assert tiers_line(storage) == (
            f"tiers: cpu (8.0 MiB); arena: 8.0 MiB in shared memory {segment.name} (4 KiB "
            f"pages; huge pages: 1 of 2 MiB available, the arena needs 4; reserve them with "
            f"`sysctl vm.nr_hugepages=6`)")
        assert not caplog.records  # no line of its own (a start-up error is one line)
    finally:
        storage.close()


def test_attach_maps_only_lmkv_huge_page_segments(tmp_path) -> None:
    with pytest.raises(SharedMemoryUnavailable, match="not a segment name"):
        SharedSegment.attach("/etc/passwd")
    with open(tmp_path / "mine", "wb+") as f:  # a file of this user, not a segment
        f.truncate(4096)
        path = f"/proc/{os.getpid()}/fd/{f.fileno()}"
        with pytest.raises(SharedMemoryUnavailable, match="not that lmkv segment"):
            SharedSegment.attach(huge_segment_name(path, "lmkv-1-abcd", os.fstat(f.fileno())))
    with pytest.raises(SharedMemoryUnavailable, match="cannot map"):
        SharedSegment.attach(f"/proc/{os.getpid()}/fd/999999#lmkv-1-abcd#1:2")


def test_attach_maps_only_the_memfd_its_name_describes() -> None:
    """A descriptor path may link to another lmkv server's memfd (a pid seen from
    another pid namespace on the same host, a pid reused): attach checks the
    memfd's full name and its inode. Plain memfds stand in for huge-page ones
    (none reserved here); the checks are the same."""
    pid = os.getpid()
    mine = os.memfd_create(f"lmkv-{pid}-abcd1234", os.MFD_CLOEXEC)
    other = os.memfd_create(f"lmkv-{pid + 1}-00ff00ff", os.MFD_CLOEXEC)  # another server's
    try:
        for fd in (mine, other):
            os.ftruncate(fd, 4096)
        good = huge_segment_name(f"/proc/{pid}/fd/{mine}", f"lmkv-{pid}-abcd1234",
                                 os.fstat(mine))
        segment = SharedSegment.attach(good, 4096)
        assert segment.size == 4096
        segment.close()
        # the descriptor links to another lmkv memfd: refused
        with pytest.raises(SharedMemoryUnavailable, match="not that lmkv segment"):
            SharedSegment.attach(huge_segment_name(f"/proc/{pid}/fd/{other}",
                                                   f"lmkv-{pid}-abcd1234", os.fstat(mine)))
        # the right link text but another file (a memfd of the same name): refused
        st = os.fstat(mine)
        forged = huge_segment_name(f"/proc/{pid}/fd/{mine}", f"lmkv-{pid}-abcd1234",
                                   os.stat_result((*st[:1], st.st_ino + 1, *st[2:])))
        with pytest.raises(SharedMemoryUnavailable, match="not that lmkv segment"):
            SharedSegment.attach(forged)
        with pytest.raises(SharedMemoryUnavailable, match="not a segment name"):
            SharedSegment.attach(f"/proc/{pid}/fd/{mine}")  # no memfd name or inode
    finally:
        os.close(mine)
        os.close(other)
