"""lmkv.contracts.mapped_file: a file read through a mapping never crashes the
process when it shrinks under the mapping (SIGBUS), whoever else handles SIGBUS.

Each case that makes a read fault runs in its own Python process: were the guard
broken, the fault would kill that process, not the test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmkv.contracts import mapped_file
from lmkv.contracts.mapped_file import MappedFile

NOT_BUILT = pytest.mark.skipif(not mapped_file.available(),
                                reason="the SIGBUS guard (lmkv._ext._busguard) is not built")

MiB = 1 << 20


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter, with ``path``: a 4 MiB file of known bytes."""
    path = tmp_path / "entry"
    path.write_bytes(bytes(range(256)) * (4 * MiB // 256))
    script = textwrap.dedent("""
        import os, sys, threading
        import torch
        from lmkv.contracts.mapped_file import MappedFile
        path = sys.argv[1]
        MiB = 1 << 20
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=120)


@NOT_BUILT
def test_views_read_the_files_bytes(tmp_path: Path) -> None:
    data = os.urandom(3 * MiB + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = MappedFile.open(fd, 100, len(data) - 100 - 7)
        assert mapped is not None
        assert bytes(mapped.view(0, 10)) == data[100:110]
        assert bytes(mapped.view(MiB, 4096)) == data[100 + MiB:100 + MiB + 4096]
        assert not mapped.damaged
        with pytest.raises(ValueError, match="outside"):
            mapped.view(mapped.length - 1, 2)
        mapped.close()
        with pytest.raises(ValueError, match="closed"):
            mapped.view(0, 1)
    finally:
        os.close(fd)


@NOT_BUILT
def test_populate_reads_a_files_missing_pages_in_and_fails_on_a_short_file(
        tmp_path: Path) -> None:
    """``populate`` faults every page of the mapped range in (the page cache's
    pages: what was reclaimed is read from the disk); a file shorter than its
    mapping makes it answer False, in this process, never SIGBUS."""
    from lmkv_backends.tiers.fs_local import _PAGE, _pages_cached_count

    if not mapped_file.can_populate():
        pytest.skip("this kernel cannot populate a mapping (MADV_POPULATE_READ)")
    # the range from 16 MiB on (a header before it), larger than a disk's usual
    # read-ahead: a populate of the wrong range leaves pages of it out
    start, size = 16 * MiB, 40 * MiB
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)

    def cached_in(first: int, end: int) -> int:
        before, through = _pages_cached_count(fd, first), _pages_cached_count(fd, end)
        assert before is not None and through is not None
        return through - before

    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no read-ahead)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _pages_cached_count(fd, size) != 0:
            pytest.skip("this kernel cannot tell (cachestat), or kept the pages")
        mapped = MappedFile.open(fd, start, size - start)
        assert mapped is not None
        assert mapped.populate()
        assert cached_in(start, size) == (size - start) // _PAGE
        assert bytes(mapped.view(MiB, 4096)) == data[start + MiB:start + MiB + 4096]
        mapped.close()
    finally:
        os.close(fd)
    # shrunk in place under the mapping (in a process of its own: were populate to
    # raise SIGBUS, it would kill that one)
    done = run(tmp_path, """
        from lmkv.contracts import mapped_file
        fd = os.open(path, os.O_RDWR)
        mapped = MappedFile.open(fd, 0, 4 * MiB)
        os.ftruncate(fd, MiB)
        print(mapped.populate(), mapped_file.can_populate())
        mapped.close()
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]  # a short file, not a kernel without it


@NOT_BUILT
def test_a_file_truncated_under_a_read_reads_zeros_and_says_so(tmp_path: Path) -> None:
    # torch copies from the mapping on another thread; pytest-like faulthandler on
    done = run(tmp_path, """
        import faulthandler
        faulthandler.enable()
        fd = os.open(path, os.O_RDWR)
        mapped = MappedFile.open(fd, 0, 4 * MiB)
        src = torch.frombuffer(mapped.view(0, 4 * MiB), dtype=torch.uint8)
        assert int(src[:256].sum()) == sum(range(256)) and not mapped.damaged
        os.ftruncate(fd, MiB)  # in place, under the mapping
        dst = torch.full((4 * MiB,), 7, dtype=torch.uint8)
        t = threading.Thread(target=dst.copy_, args=(src,))
        t.start(); t.join()
        assert mapped.damaged
        assert int(dst[MiB:].sum()) == 0  # what the file no longer has: zeros
        assert torch.equal(dst[:256], torch.arange(256, dtype=torch.uint8))
        del src
        mapped.close()
        print("alive")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"


@NOT_BUILT
@pytest.mark.parametrize("faulthandler_first", [True, False])
def test_a_fault_outside_lmkvs_mappings_still_kills(tmp_path: Path,
                                                    faulthandler_first: bool) -> None:
    # lmkv's handler passes what is not its own to the handler before it
    # (faulthandler), once, then to the default: the process dies of SIGBUS.
    # faulthandler_first false: enabled after the guard, which the next mapping
    # puts back in front of it; faulthandler reports, then raises the signal
    # again, which must end in the default, not go round the chain again.
    done = run(tmp_path, f"""
        import faulthandler, mmap
        fd = os.open(path, os.O_RDWR)
        if {faulthandler_first}:
            faulthandler.enable()
        first = MappedFile.open(fd, 0, 4096)
        if not {faulthandler_first}:
            faulthandler.enable()
            second = MappedFile.open(fd, 0, 4096)
        theirs = mmap.mmap(fd, 4 * MiB, prot=mmap.PROT_READ)
        os.ftruncate(fd, 4096)
        print("reading", flush=True)
        theirs[2 * MiB]
        print("survived")
    """)
    assert done.returncode == -signal.SIGBUS
    assert "reading" in done.stdout and "survived" not in done.stdout
    assert done.stderr.count("Fatal Python error: Bus error") == 1  # reported, once


@NOT_BUILT
def test_a_handler_installed_after_lmkvs_does_not_unguard_it(tmp_path: Path) -> None:
    # faulthandler enabled after lmkv's guard took SIGBUS: the next mapping puts
    # the guard back in front, and faults outside lmkv still reach faulthandler.
    done = run(tmp_path, """
        import faulthandler
        fd = os.open(path, os.O_RDWR)
        first = MappedFile.open(fd, 0, 4096)
        faulthandler.enable()
        mapped = MappedFile.open(fd, 0, 4 * MiB)
        os.ftruncate(fd, 4096)
        view = mapped.view(2 * MiB, 16)
        assert bytes(view) == bytes(16) and mapped.damaged
        del view
        mapped.close(); first.close()
        print("alive")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"


@NOT_BUILT
def test_a_mapping_closed_while_viewed_stays_mapped_and_guarded(tmp_path: Path) -> None:
    done = run(tmp_path, """
        from lmkv.contracts import mapped_file
        fd = os.open(path, os.O_RDWR)
        mapped = MappedFile.open(fd, 0, 4 * MiB)
        view = torch.frombuffer(mapped.view(0, 4 * MiB), dtype=torch.uint8)
        mapped.close()  # a view is alive: it lingers
        assert mapped_file._lingering == [mapped]
        os.ftruncate(fd, 4096)
        assert int(view[3 * MiB:].sum()) == 0 and mapped.damaged  # guarded still
        del view
        other = MappedFile.open(fd, 0, 4096)  # opening retries the lingering ones
        assert mapped_file._lingering == []
        other.close()
        print("alive")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"


@NOT_BUILT
def test_past_the_guards_table_files_are_not_mapped(tmp_path: Path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 5000:  # each mapping holds a descriptor: make room for 4096 of them
        if hard != resource.RLIM_INFINITY and hard < 5000:
            pytest.skip(f"4096 mappings need 4096 descriptors; the limit here is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (5000, hard))
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    held = []
    try:
        while (mapped := MappedFile.open(fd, 0, 4096)) is not None:
            held.append(mapped)
            assert len(held) <= 4096
        # the table's 4096 slots, less any that mappings elsewhere in this process hold
        assert len(held) > 4000
        for mapped in held:
            mapped.close()
        held = []
        again = MappedFile.open(fd, 0, 4096)  # the slots came back
        assert again is not None
        again.close()
    finally:
        for mapped in held:
            mapped.close()
        os.close(fd)
        if soft < 5000:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_guard_is_built_where_the_other_extension_is() -> None:
    """Both C extensions build in the same step: the token one without the guard
    means busguard.c failed to compile here (mapped reads would be off)."""
    try:
        from lmkv._ext import _tokens  # noqa: F401
    except ImportError:
        pytest.skip("no C extension was built here")
    assert mapped_file.available()

