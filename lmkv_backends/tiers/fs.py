"""The ``fs`` tier: serialized chunks as files on local disk or objects in S3 (fsspec).

One entry per chunk, named after its key (``fs_index``). On local disk
(``fs_local``) writes are atomic (durable on request); entries survive a
restart and are found again; reads go straight into chunk buffers. Other URLs
(``fs_remote``) go through fsspec. A budget (``max_bytes``) evicts unpinned
entries in the order of the tier's eviction policy. Every fault (I/O error,
stopped endpoint, corrupted entry) is a counted, rate-logged miss or dropped
write, through the backend's one fault policy (``lmkv.contracts.faults``, the tier
absorbing ``FAULTS``), and a remote that stops answering opens the tier's
breaker. Anything else is a bug: it raises, uncounted, and the storage
manager's last resort logs it loudly.
Anything under an entry's name that is not a regular file (directory, FIFO,
symlink, ...) is never read and never a hit: it is left alone and counted
(``special_files``).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from lmkv.base import affinity
from lmkv.base.errors import ConfigError, CorruptFrameError
from lmkv.contracts.direct_chunk import DirectChunk
from lmkv.contracts.faults import TierFaults
from lmkv.contracts.mapped_file import MappedFile, can_populate
from lmkv.contracts.plugin import OptionsArg
from lmkv.contracts.tier import BackendContext, StorageBackend, done_future
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj
from lmkv_backends.tiers.fs_futures import (
    count_true,
    gather,
    leading_objects,
    outcome,
    release_outcome,
)
from lmkv_backends.tiers.fs_index import EntryIndex, NotAnEntry, entry_name
from lmkv_backends.tiers.fs_local import LocalStore, NotCached, can_tell_cached
from lmkv_backends.tiers.fs_options import (
    FSOptions,
    display_url,
    local_root,
    open_remote,
)
from lmkv_backends.tiers.fs_remote import RemoteStore

logger = logging.getLogger(__name__)

#: What the fs tier absorbs as faults: I/O errors. A remote's client library may
#: raise anything; ``fs_remote`` raises it on as ``TierUnavailable`` (an OSError).
#: Corrupt entries are dropped (``drop_corrupt``), not faults. Anything else is a
#: bug and raises: the storage manager's last-resort guard logs it loudly.
FAULTS: tuple[type[BaseException], ...] = (OSError,)


class _Failed(enum.Enum):
    FAILED = "failed"


FAILED = _Failed.FAILED  # a probe that could not tell (storage failed): not a removal
#: Entries in a row whose direct open would wait for the disk before a lookup
#: hands the rest of them to the I/O threads at once.
COLD_RUN = 2
#: What the caller of each operation gets when it fails (for the fault log).
_CONSEQUENCES = {"write": "the write is dropped", "put": "the writes are dropped",
                 "evict": "the entry is left behind", "remove": "the entry is left in place",
                 "scan": "entries already stored are found as they are read",
                 "sync": "recent writes may not survive a crash", "close": "closed anyway"}


class FSBackend(StorageBackend):
    name = "fs"
    api_version = "2.2"
    Options = FSOptions

    options: FSOptions

    def __init__(self, options: OptionsArg = None, context: BackendContext | None = None) -> None:
        super().__init__(options, context)
        options, context = self.options, self.context
        serializer, policy = context.serializer, context.eviction_policy
        if serializer is None or policy is None:
            raise ValueError("the fs tier needs a serializer and an eviction policy")
        self._serializer = serializer
        self.location = display_url(options.url)
        # A client library's message may carry the endpoint URL with its credentials.
        self.faults = TierFaults(self.counters, f"fs tier {self.location}", absorbed=FAULTS,
                                 redact=options.redactor(), log=logger)
        self.special_files = 0  # names found that are not regular files
        prefix = f"tiers.{context.tier_index}.options"  # for start-up errors
        self.store: LocalStore | RemoteStore
        if options.is_local:
            try:
                self.store = LocalStore(local_root(options), options.durable,
                                        options.page_cache, options.file_mode,
                                        options.dir_mode)
            except OSError as exc:
                raise ConfigError(f"config key '{prefix}.url' = {self.location!r}: cannot use "
                                  f"the directory: {exc.strerror or exc}") from None
        else:
            self.store = RemoteStore(open_remote(options, prefix), self.faults)
        capacity = int(options.max_bytes) if options.max_bytes is not None else None
        self.index = EntryIndex(policy, capacity)
        self._raw_reads = self.store.reads_into and serializer.raw_payload
        # Entries held open for direct reads (lookups not yet loaded): at most a
        # quarter of the process's descriptors; past that, reads go to the arena.
        self._direct_lock = threading.Lock()
        self._direct_open = 0
        self._direct_cap = max(16, _descriptor_limit() // 4)
        self._closed = False
        self._pending: set[Future] = set()  # put batches not finished
        self._pending_lock = threading.Lock()
        threads = options.threads
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="lmkv-fs-read",
                                           initializer=affinity.apply)
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix="lmkv-fs-write",
                                           initializer=affinity.apply_background)
        if self.store.trust_index:
            self._load_index()  # local: the directory is the index, read it before serving
        else:
            self._readers.submit(self._load_index).add_done_callback(self._listing_done)

    def _load_index(self) -> None:
        with self._guard("scan"):
            try:
                found = self.store.scan()
            except FAULTS as exc:
                if not self._closed:
                    raise
                # closed while listing (interpreter exit, say): nobody cares
                logger.debug("lmkv fs tier %s: listing ended by close: %s", self.location, exc)
                return
            self.index.adopt_all(found)
            self._delete_evicted(self.index.excess_victims())
            logger.info("lmkv fs tier %s: %d entries, %d bytes", self.location,
                        len(self.index), self.index.usage)

    def _listing_done(self, job: Future) -> None:
        """A bug in the background listing has no caller to raise into: say it loudly."""
        exc = None if job.cancelled() else job.exception()
        if exc is not None:
            self.faults.last_resort("scan", exc, _CONSEQUENCES["scan"])

    # -- figures -----------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        return self.index.usage

    @property
    def capacity_bytes(self) -> int | None:
        return self.index.capacity

    def stats(self) -> dict[str, int | None]:
        scanned = getattr(self.store, "special_files", 0)
        return {**super().stats(), "entries": len(self.index),
                "special_files": self.special_files + scanned}

    @property
    def lookups_in_memory(self) -> bool:  # type: ignore[override]  # (read-only here)
        """On local disk the index is in memory (a miss stats one file) and reads
        run on the I/O threads (direct ones open cached entries at once)."""
        return isinstance(self.store, LocalStore)

    # -- lookup --------------------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        if self.store.trust_index and self.index.lookup(key, pin):
            return True
        return self._present(key, self._probe(key), pin)

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        if self.store.trust_index:
            hits = self.index.count_prefix(keys, pin)
            # the index missed: another process may have written the rest since
            while hits < len(keys) and self._present(keys[hits], self._probe(keys[hits]), pin):
                hits += 1
            return hits
        probes = [self._submit(self._readers, self._probe, key) for key in keys]
        hits = 0
        try:
            for key, probe in zip(keys, probes, strict=True):
                if not self._present(key, outcome(probe, FAILED) if probe else FAILED, pin):
                    break
                hits += 1
        finally:  # also when a probe raised (a bug): the rest is not needed
            for probe in probes[hits:]:
                if probe is not None:
                    probe.cancel()
        return hits

    def _probe(self, key: CacheKey) -> int | _Failed | None:
        """The stored size of ``key``, None when absent, FAILED when the storage failed."""
        if self._closed:
            return FAILED
        with self._guard("stat", key):
            try:
                return self.store.stat(entry_name(key))
            except NotAnEntry as exc:
                self._special(key, exc)
                return None
        return FAILED

    def _present(self, key: CacheKey, size: int | _Failed | None, pin: bool) -> bool:
        if size is FAILED:
            return False
        if size is None:
            if not self.store.trust_index:
                self.index.discard(key)  # removed by another process
            return False
        self.index.adopt(key, size, pin)
        return True

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        return self.index.unpin(key)

    # -- put -----------------------------------------------------------------------
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        jobs: list[Future] = []
        lineage = parents if parents is not None else [None] * len(keys)
        for key, obj, parent in zip(keys, objs, lineage, strict=True):
            if not self.index.begin_write(key):
                continue
            if not obj.ref_up():  # written from the buffer itself: keep it alive until then
                self.index.end_write(key)  # a released buffer: never store it
                continue
            job = self._submit(self._writers, self._write, key, obj, parent)
            if job is None:
                self._write_finished(key, obj, None)
                continue
            job.add_done_callback(partial(self._write_finished, key, obj))
            jobs.append(job)
        batch = gather(jobs, count_true, self._sync)
        if not batch.done():
            with self._pending_lock:
                self._pending.add(batch)
            batch.add_done_callback(self._batch_finished)
        return batch

    def _batch_finished(self, batch: Future) -> None:
        with self._pending_lock:
            self._pending.discard(batch)

    def _write(self, key: CacheKey, obj: MemoryObj, parent: CacheKey | None = None) -> bool:
        name = entry_name(key)
        with self._guard("write", key):
            try:
                existing = self.store.stat(name)
            except NotAnEntry as exc:  # not ours to replace
                self._special(key, exc)
                self.counters.dropped_writes += 1
                return False
            if existing is not None:  # another process stored it
                self.index.adopt(key, existing, parent=parent)
                return False
            buffers = self._serializer.serialize(obj, key)
            size = sum(memoryview(b).nbytes for b in buffers)
            evicted = self.index.reserve(size)
            if evicted is None:
                self.counters.dropped_writes += 1
                self.faults.note("full", "no room for an entry of %d bytes (budget %s, all "
                                 "else pinned); dropping the write", size, self.index.capacity)
                return False
            self._delete_evicted(evicted)
            try:
                written = self.store.write(name, buffers)
            except BaseException:
                self.index.release(size)
                raise
            self.index.commit(key, size, written, parent)
            self.counters.puts += 1
            self.counters.bytes_in += written
            return True
        self.counters.dropped_writes += 1
        return False

    def _write_finished(self, key: CacheKey, obj: MemoryObj, job: Future | None) -> None:
        if job is None or job.cancelled():  # closed before it ran
            self.counters.dropped_writes += 1
        self.index.end_write(key)
        obj.ref_down()

    def _sync(self) -> None:
        with self._guard("sync"):
            self.store.sync()

    def _delete_evicted(self, evicted: list[tuple[CacheKey, int]]) -> None:
        for key, _ in evicted:
            with self._guard("evict", key):
                self.store.delete(entry_name(key))
        self.counters.evictions += len(evicted)

    # -- get ------------------------------------------------------------------------
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        found = self._read(key, self._read_in)
        return None if found is None else self._served(key, *found)

    def _read_in(self, name: str, key: CacheKey) -> tuple[MemoryObj | None, int]:
        """The entry read into a chunk buffer: ``(buffer, entry size)``; no buffer
        when the arena has no room."""
        store, allocate = self.store, self.context.allocate
        if self._raw_reads and isinstance(store, LocalStore) and allocate is not None:
            return store.read_into(name, key, self._serializer.serializer_id, allocate)
        frame = self.store.read_frame(name)
        return self.decode(key, frame), len(frame)

    def _read(self, key: CacheKey, read: Callable[[str, CacheKey], tuple[Any, int]]
              ) -> tuple[Any, int] | None:
        """``read(entry name, key)`` under the tier's fault policy: what it read and
        the entry's size, or None for a miss (counted). A missing entry is
        forgotten, something that is not an entry file noted, a corrupt one
        dropped."""
        if self._closed:
            self.counters.misses += 1
            return None
        found: tuple[Any, int] | None = None
        with self._guard("read", key):
            try:
                found = read(entry_name(key), key)
            except FileNotFoundError:
                self.index.discard(key)
            except NotAnEntry as exc:
                self._special(key, exc)
            except CorruptFrameError as exc:  # read straight into a buffer, or decoded
                self.drop_corrupt(key, exc)
        if found is None or found[0] is None:
            self.counters.misses += 1
            return None
        return found

    def _served(self, key: CacheKey, obj: Any, size: int) -> Any:
        """Count a hit of ``size`` bytes on ``key``; ``obj``, what it served."""
        self.index.adopt(key, size)
        self.index.touch(key)
        self.counters.hits += 1
        self.counters.bytes_out += size
        return obj

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey],
                                 get: Callable[[CacheKey], object] | None = None,
                                 before: Sequence[Future] = ()) -> Future:
        """``before``: the futures of entries read already, ahead of ``keys``."""
        jobs: list[Future] = list(before)
        for key in keys:
            job = self._submit(self._readers, get or self.get_blocking, key)
            if job is None:  # closed: what was started still counts as a prefix
                self.counters.misses += 1
                break
            jobs.append(job)
        return gather(jobs, leading_objects)

    def batched_get_direct(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future | None:
        """Entries on local disk left in place (``lmkv.contracts.direct_chunk``): each key's header
        is read and checked now, its payload when the engine reads it."""
        if not (self._raw_reads and self.options.direct_reads
                and isinstance(self.store, LocalStore)):
            return None
        if not can_tell_cached():
            return self.batched_get_non_blocking(lookup_id, keys, self._get_direct)
        # Entries wholly in the page cache are opened here, one after another
        # (about 0.1 ms each: less than a hand-off to another thread costs, and
        # far less while the engine's own threads keep every CPU busy); an entry
        # whose header or payload would wait for the disk goes to the I/O threads,
        # in parallel with the rest, and after ``COLD_RUN`` such entries in a row
        # so does the rest (a tier that is cold as a whole: its opens would wait
        # too).
        jobs: list[Future] = []
        cold = 0  # entries in a row that would have waited
        try:
            for i, key in enumerate(keys):
                if self._closed:
                    self.counters.misses += 1
                    break
                if cold >= COLD_RUN:  # the rest is likely off the disk too (inodes as well)
                    return self.batched_get_non_blocking(lookup_id, keys[i:],
                                                         self._get_direct, jobs)
                try:
                    got = self._get_direct(key, nowait=True)
                except NotCached:
                    cold += 1
                    job = self._submit(self._readers, self._get_direct, key)
                    if job is None:  # closed meanwhile
                        self.counters.misses += 1
                        break
                    jobs.append(job)
                    continue
                cold = 0
                jobs.append(done_future(got))
                if got is None:
                    break
        except BaseException:  # a bug: what the I/O threads open goes back as it comes
            for job in jobs:
                job.add_done_callback(release_outcome)
            raise
        return gather(jobs, leading_objects)

    def _get_direct(self, key: CacheKey, nowait: bool = False
                    ) -> DirectChunk | MemoryObj | None:
        """``key``'s entry opened for a direct read (read in when it cannot be left
        in place), or None. ``nowait``: ``NotCached`` when its header is not in the
        page cache, or part of its payload is not and would be read in before it
        is mapped (nothing counted): the I/O threads open it then."""
        store = self.store
        assert isinstance(store, LocalStore)
        serializer_id = self._serializer.serializer_id
        found = self._read(key, lambda name, k: store.open_payload(name, k, serializer_id,
                                                                   nowait))
        if found is None:
            return None
        (fd, header, cached), size = found
        populate = (not cached and self.options.mapped_reads and store.page_cache
                    and len(header.shape) == 5 and can_populate())
        if populate and nowait:  # its missing pages are read on the I/O threads
            os.close(fd)
            raise NotCached(key.to_string())
        with self._direct_lock:
            held = self._direct_open < self._direct_cap
            if held:
                self._direct_open += 1
        if len(header.shape) != 5 or not held:  # an alias, or descriptors run short:
            if held:                              # read it in
                self._direct_closed()
            os.close(fd)
            if nowait:  # read in on the I/O threads
                raise NotCached(key.to_string())
            return self.get_blocking(key)
        # Mapped when in the page cache (no copy into the staging buffer). An
        # entry partly out of it is mapped once its missing pages are read in
        # (the disk started at open; ``populate`` waits for it, here, on an I/O
        # thread): never through faults, one synchronous read per missing page.
        # Where that cannot be done, pread's large requests read it. Not with
        # page_cache off: its reads hand their pages back on close.
        mapped = None
        if self.options.mapped_reads and (cached or populate) and store.page_cache:
            try:
                mapped = MappedFile.open(fd, header.header_len, header.payload_len)
                if mapped is not None and populate and not mapped.populate():
                    mapped.close()
                    mapped = None
            except BaseException:
                if mapped is not None:
                    mapped.close()
                os.close(fd)
                self._direct_closed()
                raise
        if mapped is not None:
            # The mapping holds a descriptor of its own: this one goes now.
            os.close(fd)
            chunk = DirectChunk(key, header.shape, header.dtype, header.checksum,
                                partial(_read_mapped, mapped),
                                partial(self._direct_failed, key),
                                partial(self._close_mapped, mapped), mapped=mapped)
        else:
            chunk = DirectChunk(key, header.shape, header.dtype, header.checksum,
                                partial(store.read_payload, fd, header),
                                partial(self._direct_failed, key),
                                partial(self._close_direct, store, fd))
        return self._served(key, chunk, size)

    def _close_direct(self, store: LocalStore, fd: int) -> None:
        try:
            store.close_payload(fd)
        finally:
            self._direct_closed()

    def _close_mapped(self, mapped: MappedFile) -> None:
        try:
            mapped.close()
        finally:
            self._direct_closed()

    def _direct_closed(self) -> None:
        with self._direct_lock:
            self._direct_open -= 1

    def _direct_failed(self, key: CacheKey, exc: BaseException) -> None:
        """A direct read's piece failed or its checksum differed: as for a get."""
        if isinstance(exc, CorruptFrameError):
            self.drop_corrupt(key, exc)
        else:
            self.faults.fault("read", exc, "the load stops there", key)

    # -- the rest -----------------------------------------------------------------------
    def remove(self, key: CacheKey) -> bool:
        """Drop ``key`` (pins guard against eviction, not against removal)."""
        known = self.index.discard(key)
        name = entry_name(key)
        with self._guard("remove", key):
            try:
                if not known and self.store.stat(name) is None:
                    return False
                return self.store.delete(name) or known
            except NotAnEntry:
                return known
        return known

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., object],
                *args: object) -> Future | None:
        if self._closed:
            return None
        try:
            return pool.submit(fn, *args)
        except RuntimeError:  # shut down meanwhile
            return None

    def _guard(self, op: str, key: CacheKey | None = None) -> AbstractContextManager[None]:
        """The tier's fault policy around one operation: an I/O error is a counted,
        logged fault (the caller answers its miss); anything else raises."""
        return self.faults.guard(op, _CONSEQUENCES.get(op, "a miss"), key or "")

    def _special(self, key: CacheKey, exc: NotAnEntry) -> None:
        """Something that is not an entry file sits under ``key``'s name: forget the
        key, leave the thing alone, count it."""
        self.index.discard(key)
        self.special_files += 1
        self.faults.note("special", "ignoring %s (a miss)", exc)

    def close(self) -> None:
        """Waits up to ``close_timeout_s`` for puts in flight; the rest is cancelled
        (buffers released, counted as dropped). A request still running ends
        within the remote's timeouts, on its own thread."""
        if self._closed:
            return
        self._closed = True
        with self._pending_lock:
            pending = list(self._pending)
        if pending:
            wait(pending, timeout=self.options.close_timeout_s)
        for pool in (self._readers, self._writers):
            pool.shutdown(wait=False, cancel_futures=True)
        with self._guard("close"):
            self.store.close()
        super().close()


def _descriptor_limit() -> int:
    try:
        import resource
    except ImportError:  # not a Unix
        return 1024
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else int(soft)


def _read_mapped(mapped: MappedFile, offset: int, view: memoryview) -> None:
    """A mapped entry's ``read_at``: the payload's bytes from ``offset`` copied out
    of the mapping (CorruptFrameError when the file shrank under it)."""
    view[:] = mapped.view(offset, view.nbytes)
    if mapped.damaged:
        raise CorruptFrameError("the entry shrank while it was read")
