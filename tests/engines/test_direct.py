"""Direct reads (lmkv.contracts.direct_chunk): a fresh engine whose KV is in host memory reads a
disk tier's entries straight into its paged caches, verified, never promoted;
a corrupt, truncated or swapped entry ends the load before it (the rest is
recomputed) and never lands as KV of another prompt."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmkv import KVSpec, load_config
from lmkv.contracts.direct_chunk import DirectChunk
from lmkv.engines.local import LocalEngine
from lmkv.testing.engines import open_local_engine
from lmkv_backends.tiers.fs_index import entry_name

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
CHUNK = 32
BLOCK = 16
LAYER_BYTES = 2 * CHUNK * 2 * 16 * 2  # planes x tokens x heads x dim x fp16


MAPPED = {"mapped_reads": True}  # the reads fixture's choice for every engine here
ORDER = {"spec": SPEC}  # the order fixture's choice: the spec every engine here has


@pytest.fixture(autouse=True, params=[False, True], ids=["l2thd", "lht2d"])
def order(request: pytest.FixtureRequest) -> bool:
    """Every test with chunks in the canonical order and held heads outer (the
    spec vLLM's cpu caches get from the paged connector)."""
    ORDER["spec"] = replace(SPEC, heads_outer=request.param)
    return request.param


@pytest.fixture(autouse=True, params=[True, False], ids=["mapped", "pread"])
def reads(request: pytest.FixtureRequest) -> bool:
    """Every test reads entries through a guarded mapping and with pread."""
    from lmkv.contracts import mapped_file

    if request.param and not mapped_file.available():
        pytest.skip("the SIGBUS guard (lmkv._ext._busguard) is not built")
    MAPPED["mapped_reads"] = request.param
    return request.param


def config(root: Path, **fs_options):
    fs_options = {**MAPPED, **fs_options}
    return load_config(env={}, overrides={
        "lmkv.chunk_size": CHUNK, "lmkv.gpu_connector": "paged",
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "4MiB"}},
                       {"type": "fs", "options": {"url": str(root), **fs_options}}]})


def engine(root: Path, direct: bool = True, **fs_options) -> LocalEngine:
    return open_local_engine(config(root, **fs_options), ORDER["spec"], model_name="direct",
                             kv_kind="paged", block_size=BLOCK, direct_reads=direct)


def caches(seed: int | None = None) -> list[torch.Tensor]:
    """cpu-layout paged caches ``[blocks, heads, block, 2 * dim]``: 16 blocks."""
    if seed is None:
        return [torch.zeros(16, 2, BLOCK, 32).half() for _ in range(SPEC.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 2, BLOCK, 32, generator=gen).half() for _ in range(4)]


def stored(root: Path, tokens: list[int], seed: int = 1) -> list[torch.Tensor]:
    """A first process's store: the KV of ``tokens`` in blocks 0.. of its caches."""
    src = caches(seed)
    with engine(root, direct=False) as writer:
        assert writer.store(tokens, kv_caches=src, block_ids=list(range(16))) == len(tokens)
        assert writer.storage.flush(10)
    return src


def blocks_equal(src, dst, pairs) -> bool:
    return all(torch.equal(s[a], d[b]) for s, d in zip(src, dst, strict=True) for a, b in pairs)


def taken_by(reader: LocalEngine) -> list:
    """What the reader's loads take from its lookups, from now on (a spy)."""
    taken: list = []
    original = reader.storage.take_prefetched

    def spy(*args, **kwargs):
        objs = original(*args, **kwargs)
        taken.extend(objs or [])
        return objs

    reader.storage.take_prefetched = spy  # type: ignore[method-assign]
    return taken


def load(reader: LocalEngine, tokens: list[int], target, block_ids, lookup_id: str = "r",
         **kv):
    hit = reader.lookup_and_prefetch(tokens, lookup_id).result(10)
    got = reader.retrieve(tokens, lookup_id=lookup_id, kv_caches=target, block_ids=block_ids,
                          **kv).num_tokens
    return hit, got


@pytest.mark.parametrize("piece_bytes", [LAYER_BYTES, 3 * LAYER_BYTES, 1 << 20])
def test_a_fresh_engine_reads_disk_chunks_straight_into_its_kv(tmp_path: Path,
                                                               piece_bytes: int) -> None:
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        assert reader.direct is not None
        reader.direct.piece_bytes = piece_bytes  # one layer, 3 (+1), all at once
        taken = taken_by(reader)
        target = caches()
        blocks = [9, 3, 12, 0, 5, 7, 1, 14]
        assert load(reader, tokens, target, blocks) == (128, 128)
        assert taken and all(isinstance(o, DirectChunk) for o in taken)
        assert blocks_equal(src, target, list(zip(range(8), blocks, strict=True)))
        assert reader.storage.tiers[0].usage_bytes == 0  # never promoted


def test_skipped_tokens_and_a_shorter_hit_are_left_alone(tmp_path: Path) -> None:
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        target = caches(seed=9)
        before = [c.clone() for c in target]
        blocks = [2, 4, 6, 8, 10, 11]  # 6 blocks: the prompt's first 96 tokens
        prompt = tokens[:90] + [7777] * 6
        hit, got = load(reader, prompt, target, blocks, skip_tokens=BLOCK)
        # two whole chunks read direct, then the next chunk's first block (a block-
        # granular hit: read into memory, the chunk cut to it)
        assert (hit, got) == (80, 80)
        assert blocks_equal(before, target, [(2, 2)])  # skipped: untouched
        assert blocks_equal(src, target, [(1, 4), (2, 6), (3, 8), (4, 10)])
        assert blocks_equal(before, target, [(11, 11)])


@pytest.mark.parametrize("damage", ["flip", "truncate", "shrink", "swap"])
def test_a_damaged_entry_ends_the_load_before_it(tmp_path: Path, damage: str) -> None:
    # shrink: to a third, in place, after the lookup mapped it: reading the pages
    # the file lost would raise SIGBUS in a mapped read without lmkv's guard
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    other = list(range(5000, 5000 + 4 * CHUNK))
    stored(tmp_path, other, seed=2)
    with engine(tmp_path) as reader:
        keys = reader.chunker.chunk(tokens).keys
        path = tmp_path / entry_name(keys[2])
        if damage == "swap":  # another prompt's entry under this key's name
            os.replace(tmp_path / entry_name(reader.chunker.chunk(other).keys[2]), path)
        hit = reader.lookup_and_prefetch(tokens, "r").result(10)
        if damage == "flip":  # after the lookup checked the header: caught by the checksum
            with open(path, "r+b") as f:
                f.seek(-3, os.SEEK_END)
                byte = f.read(1)
                f.seek(-3, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncate":
            os.truncate(path, os.path.getsize(path) - 100)
        elif damage == "shrink":
            os.truncate(path, os.path.getsize(path) // 3)
        target = caches()
        blocks = list(range(8))
        got = reader.retrieve(tokens, lookup_id="r", kv_caches=target,
                              block_ids=blocks).num_tokens
        assert got == 64
        assert hit == (64 if damage == "swap" else 128)
        assert blocks_equal(src, target, [(b, b) for b in range(4)])
        fs = reader.storage.tiers[1]
        assert fs.counters.corrupt_frames == 1
        assert not path.exists()  # dropped
        # The next lookup is a clean miss there, never the damaged KV.
        assert reader.lookup_and_prefetch(tokens, "again").result(10) == 64
        reader.release_lookup("again")


def checked_here(order: bool, reads: bool) -> None:
    """Skip unless this engine's loads go to the connector's checked copies."""
    from lmkv_kernels import host_impl

    if not (order and reads and host_impl.can_check()):
        pytest.skip("checked loads: mapped chunks held heads outer, the C copies with "
                    "libxxhash")


def test_mapped_chunks_load_checked_in_one_call(tmp_path: Path, order: bool,
                                                reads: bool) -> None:
    checked_here(order, reads)
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        original, calls = reader.direct._checker, []
        assert original is not None

        def spy(spans, checksums, **kv):
            calls.append(len(spans))
            return original(spans, checksums, **kv)

        reader.direct._checker = spy
        target = caches()
        assert load(reader, tokens, target, list(range(8, 16))) == (128, 128)
        assert calls == [4]
        assert blocks_equal(src, target, [(b, b + 8) for b in range(8)])


@pytest.mark.parametrize("answer", ["too few", "ints", "a generator", "a bool", "numpy"])
def test_a_connector_that_answers_no_verdicts_is_read_around_and_blames_no_entry(
        tmp_path: Path, order: bool, reads: bool, answer: str) -> None:
    """A checked load answered with anything but a bool per chunk (numpy's and a
    generator's are taken): lmkv reads the chunks itself (verified), blames no
    entry, and asks the connector no more."""
    import numpy as np

    checked_here(order, reads)
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    bent = {"too few": lambda v: v[:-1], "ints": lambda v: [int(x) for x in v],
            "a generator": lambda v: (x for x in v), "a bool": lambda v: True,
            "numpy": lambda v: np.array(v)}[answer]
    with engine(tmp_path) as reader:
        original, calls = reader.direct._checker, []

        def bad(spans, sums, **kv):
            calls.append(len(spans))
            return bent(original(spans, sums, **kv))

        reader.direct._checker = bad
        target = caches()
        assert load(reader, tokens, target, list(range(8))) == (128, 128)
        assert blocks_equal(src, target, [(b, b) for b in range(8)])
        assert reader.storage.tiers[1].counters.corrupt_frames == 0
        if answer in ("numpy", "a generator"):  # (bools all the same)
            assert reader.direct._checker is bad
            return
        assert reader.direct._checker is None and calls == [4]
        assert load(reader, tokens, caches(), list(range(8)), "again") == (128, 128)
        assert calls == [4]


def test_released_lookups_give_their_files_back(tmp_path: Path) -> None:
    tokens = list(range(4 * CHUNK))
    stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(5):
            assert reader.lookup_and_prefetch(tokens, f"r{i}").result(10) == 128
            reader.release_lookup(f"r{i}")
        reader.storage.events.cleanup("none")
        assert len(os.listdir("/proc/self/fd")) <= fds


def test_direct_reads_off_reads_through_the_arena_and_promotes(tmp_path: Path) -> None:
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path, direct_reads=False) as reader:
        target = caches()
        assert load(reader, tokens, target, list(range(8))) == (128, 128)
        assert blocks_equal(src, target, [(b, b) for b in range(8)])
        assert reader.storage.tiers[0].usage_bytes > 0  # promoted


def test_an_engine_without_direct_reads_never_gets_direct_chunks(tmp_path: Path) -> None:
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path, direct=False) as reader:
        assert reader.direct is None
        target = caches()
        assert load(reader, tokens, target, list(range(8))) == (128, 128)
        assert blocks_equal(src, target, [(b, b) for b in range(8)])


def test_a_release_during_a_read_closes_after_it_and_blames_nobody(tmp_path: Path) -> None:
    import threading

    import xxhash

    from lmkv.contracts.direct_chunk import ChunkReleased

    tokens = list(range(4 * CHUNK))
    stored(tmp_path, tokens)
    with engine(tmp_path, mapped_reads=False) as reader:  # a read that waits on the disk
        fs = reader.storage.tiers[1]
        key = reader.chunker.chunk(tokens).keys[0]
        chunk = fs.batched_get_direct("x", [key]).result(10)[0]
        assert isinstance(chunk, DirectChunk)
        entered, go = threading.Event(), threading.Event()
        read_at = chunk._read_at

        def slow(offset, view):  # the disk is slow: the load is given up on meanwhile
            entered.set()
            go.wait(10)
            read_at(offset, view)

        chunk._read_at = slow
        errors = []

        def read() -> None:
            try:
                chunk.read_piece(0, 1, torch.zeros(LAYER_BYTES, dtype=torch.uint8),
                                 xxhash.xxh3_64())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        assert entered.wait(10)
        chunk.ref_down()  # while the read is in flight: the descriptor stays open
        assert chunk._closer.alive
        go.set()
        thread.join(10)
        assert len(errors) == 1 and isinstance(errors[0], ChunkReleased)
        assert not chunk._closer.alive  # closed by the read, after it
        assert fs.counters.corrupt_frames == 0 and fs.contains(key)
        assert fs._direct_open == 0


def test_read_piece_reads_the_stored_layers_and_fails_a_shrunk_entry(
        tmp_path: Path, reads: bool) -> None:
    # piece by piece into a staging buffer (read_at: pread, or a copy out of the
    # mapping), each layer the one stored; an entry truncated in place fails the
    # read as corrupt (the guard turns a mapped read's SIGBUS into that)
    import xxhash

    from lmkv.base.errors import CorruptFrameError

    tokens = list(range(CHUNK))
    stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        fs = reader.storage.tiers[1]
        key = reader.chunker.chunk(tokens).keys[0]
        whole = fs.get_blocking(key)
        assert whole is not None
        chunk = fs.batched_get_direct("x", [key]).result(10)[0]
        assert isinstance(chunk, DirectChunk) and (chunk._mapped is not None) == reads
        staging = torch.zeros(LAYER_BYTES, dtype=torch.uint8)
        hasher = xxhash.xxh3_64()
        for layer in range(2):
            piece = chunk.read_piece(layer, 1, staging, hasher)
            assert torch.equal(piece[0], whole.tensor[layer])
        os.truncate(tmp_path / entry_name(key), LAYER_BYTES)  # in place, under the reader
        with pytest.raises(CorruptFrameError):
            chunk.read_piece(3, 1, staging, hasher)
        assert fs.counters.corrupt_frames == 1
        whole.ref_down()
        chunk.ref_down()


def test_past_the_descriptor_cap_chunks_are_read_in(tmp_path: Path) -> None:
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        fs = reader.storage.tiers[1]
        fs._direct_cap = 2
        got = fs.batched_get_direct("x", reader.chunker.chunk(tokens).keys).result(10)
        assert len(got) == 4  # (opened in parallel: which two stay open varies)
        assert sum(isinstance(o, DirectChunk) for o in got) == 2
        for obj in got:
            obj.ref_down()
        assert fs._direct_open == 0
        target = caches()
        assert load(reader, tokens, target, list(range(8))) == (128, 128)
        assert blocks_equal(src, target, [(b, b) for b in range(8)])


def test_an_entry_that_cannot_be_opened_is_a_fault_not_a_foreign_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from lmkv_backends.tiers import fs_local

    tokens = list(range(CHUNK))
    stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        fs = reader.storage.tiers[1]
        key = reader.chunker.chunk(tokens).keys[0]
        real_open = fs_local.os.open

        def no_descriptors(path, *args, **kwargs):
            if str(path).startswith(str(tmp_path)):
                raise OSError(errno.EMFILE, "Too many open files")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(fs_local.os, "open", no_descriptors)
        assert fs.get_blocking(key) is None
        assert fs.counters.errors == 1 and fs.special_files == 0
        monkeypatch.undo()
        assert fs.contains(key)  # still indexed: read again once descriptors are back


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "no-populate"])
def test_an_entry_partly_out_of_the_page_cache_is_read_in_before_it_is_mapped(
        tmp_path: Path, monkeypatch, populate: bool, reads: bool) -> None:
    """The kernel reclaims an idle file's pages piecemeal: an entry whose last page
    is cached but a middle one is not has its missing pages read in at lookup
    (``MappedFile.populate``, on the I/O threads) and is then mapped; where the
    kernel cannot populate a mapping, it is read with pread (large requests,
    the disk started at lookup). Never a mapping that faults page by page; its
    KV loads all the same."""
    from lmkv.contracts import mapped_file
    from lmkv_backends.tiers import fs_local

    if populate and not mapped_file.can_populate():
        pytest.skip("this kernel cannot populate a mapping (MADV_POPULATE_READ)")
    populated: list[str] = []  # the threads that populated, and whether it worked
    real = mapped_file.MappedFile.populate

    def spied(self):  # type: ignore[no-untyped-def]
        done = real(self)
        populated.append(f"{threading.current_thread().name.split('_')[0]} {done}")
        return done

    monkeypatch.setattr(mapped_file.MappedFile, "populate", spied)
    if not populate:
        monkeypatch.setattr(mapped_file, "_POPULATE_REFUSED", [True])

    tokens = list(range(2 * CHUNK))
    src = stored(tmp_path, tokens)
    # (the chunks' entries: not the small aliases block-granular hits name)
    files = [p for p in tmp_path.iterdir() if p.suffix == ".lmkv" and p.stat().st_size > 8192]
    assert len(files) == 2
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            os.fsync(fd)
            # out of the page cache, then its first and last pages read back alone
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no read-ahead)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            last = (size - 1) // 4096 * 4096
            os.pread(fd, 4096, 0)
            os.pread(fd, size - last, last)
            if fs_local._pages_cached(fd, size) is not False:
                pytest.skip("this kernel cannot tell (cachestat), or kept the pages")
        finally:
            os.close(fd)
    with engine(tmp_path) as reader:
        taken = taken_by(reader)
        target = caches()
        assert load(reader, tokens, target, [9, 3, 12, 0]) == (64, 64)
        assert taken and all(isinstance(o, DirectChunk) and o.mapped == (populate and reads)
                             for o in taken)
        # (an entry whose read-ahead, started at its first open, is done by the
        # time an I/O thread opens it again is whole then: mapped at once)
        assert len(populated) <= (len(taken) if populate and reads else 0)
        # on the I/O threads, never the lookup's own, and it worked
        assert set(populated) <= {"lmkv-fs-read True"}, populated
        assert blocks_equal(src, target, [(0, 9), (1, 3), (2, 12), (3, 0)])


#: An entry whose pages were dropped can still be read at once: a read that may
#: not wait (RWF_NOWAIT) starts the disk, and a disk fast enough (a VM's disk
#: over the host's page cache) has answered by the time the kernel looks again.
#: Nothing waited then, and there is nothing to hand over.
_AT_ONCE = "the disk answered a read that could not wait: no entry would have waited"


def test_only_an_entry_that_would_wait_for_the_disk_leaves_the_lookups_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries in the page cache are opened by the lookup itself; one out of it is
    opened on the tier's I/O threads, and the entries after it are still opened
    by the lookup (not handed over with it): a hand-off costs more than an open
    while the engine's threads keep the CPUs busy. The KV loads all the same."""
    from lmkv_backends.tiers import fs as fs_tier
    from lmkv_backends.tiers import fs_local

    if not fs_local.can_tell_cached():
        pytest.skip("this kernel cannot read without waiting (RWF_NOWAIT)")
    tokens = list(range(3 * CHUNK))
    src = stored(tmp_path, tokens)
    with engine(tmp_path) as reader:
        keys = reader.chunker.chunk(tokens).keys
        fd = os.open(tmp_path / entry_name(keys[1]), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if fs_local._pages_cached(fd, os.fstat(fd).st_size) is not False:
                pytest.skip("this kernel cannot tell (cachestat), or kept the pages")
        finally:
            os.close(fd)
        opened: dict[int, str] = {}
        real = fs_tier.FSBackend._get_direct

        answered_at_once: list[int] = []

        def spied(self, key, nowait=False):  # type: ignore[no-untyped-def]
            got = real(self, key, nowait)  # (raises NotCached for the one out of it)
            if nowait and keys.index(key) == 1:
                answered_at_once.append(1)
            opened[keys.index(key)] = threading.current_thread().name.split("_")[0]
            return got

        monkeypatch.setattr(fs_tier.FSBackend, "_get_direct", spied)
        target = caches()
        assert load(reader, tokens, target, [9, 3, 12, 0, 5, 7]) == (96, 96)
        if answered_at_once:
            pytest.skip(_AT_ONCE)
        assert opened[1] == "lmkv-fs-read", opened
        assert opened[0] != "lmkv-fs-read" and opened[2] != "lmkv-fs-read", opened
        assert blocks_equal(src, target, list(zip(range(6), [9, 3, 12, 0, 5, 7],
                                                  strict=True)))


def test_a_tier_cold_as_a_whole_is_opened_on_the_io_threads_after_two_tries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry out of the page cache (a restarted host, say): after ``COLD_RUN``
    entries in a row that would wait, the lookup stops trying the rest on its
    own thread (opening a cold file waits for the disk too) and hands them all
    to the I/O threads. The KV loads all the same."""
    from lmkv_backends.tiers import fs as fs_tier
    from lmkv_backends.tiers import fs_local

    if not fs_local.can_tell_cached():
        pytest.skip("this kernel cannot read without waiting (RWF_NOWAIT)")
    tokens = list(range(4 * CHUNK))
    src = stored(tmp_path, tokens)
    for path in tmp_path.iterdir():
        if path.suffix == ".lmkv":
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    with engine(tmp_path) as reader:
        keys = reader.chunker.chunk(tokens).keys
        fd = os.open(tmp_path / entry_name(keys[3]), os.O_RDONLY)
        try:
            if fs_local._pages_cached(fd, os.fstat(fd).st_size) is not False:
                pytest.skip("this kernel cannot tell (cachestat), or kept the pages")
        finally:
            os.close(fd)
        tried: list[int] = []
        real = fs_tier.FSBackend._get_direct

        answered_at_once: list[int] = []

        def spied(self, key, nowait=False):  # type: ignore[no-untyped-def]
            if nowait:
                tried.append(keys.index(key))
            got = real(self, key, nowait)
            if nowait:
                answered_at_once.append(keys.index(key))
            return got

        monkeypatch.setattr(fs_tier.FSBackend, "_get_direct", spied)
        target = caches()
        blocks = [9, 3, 12, 0, 5, 7, 1, 14]
        assert load(reader, tokens, target, blocks) == (128, 128)
        if answered_at_once:
            pytest.skip(_AT_ONCE)
        assert tried == list(range(fs_tier.COLD_RUN)), tried
        assert blocks_equal(src, target, list(zip(range(8), blocks, strict=True)))
