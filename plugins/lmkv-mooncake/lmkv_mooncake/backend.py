"""The ``mooncake`` tier: lmkv frames in a Mooncake Store pool.

Every batch is one call into the store: a lookup of 128 keys is one
``batch_is_exist`` (one round trip to the master), a get is one
``batch_get_buffer`` (the master names the replicas, the transfer engine
moves every frame into Mooncake's registered local buffer, from which each is
checked and decoded into lmkv's arena), a put is one existence check and one
``batch_put_from_multi_buffers`` per staging window (see ``writer``).

Pins are local: this process counts them so it knows what it is about to
read. The store evicts by its own policy (and holds a lease on an entry while
it is read); a pinned entry the store evicted is simply a miss.

Faults follow lmkv's one policy (``lmkv.contracts.faults``): a failed call is a counted,
rate-logged miss or dropped write; a master out of reach opens the tier's
breaker for ``retry_after_s``. A frame that fails its checks (checksum, key
digest, shape) is a miss and is removed from the pool.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lmkv.contracts import (
    BackendContext,
    CacheKey,
    ConfigError,
    MemoryAllocator,
    MemoryObj,
    OptionsArg,
    PinTable,
    PrefixGets,
    Redactor,
    StorageBackend,
    apply_affinity,
    read_header,
    read_windows,
    remote_faults,
    secrets_in,
)
from lmkv_mooncake.arena_reads import (
    ABSENT,
    FOUND,
    OTHER_LAYOUT,
    Fetched,
    Layout,
    fetch,
    fetch_ranged,
    has_sessions,
    settle,
)
from lmkv_mooncake.client import (
    NOT_THERE,
    OBJECT_NOT_FOUND,
    Link,
    MasterUnreachable,
    MixedClients,
    MooncakeError,
    TierClosed,
    raise_for,
)
from lmkv_mooncake.options import MooncakeOptions
from lmkv_mooncake.writer import THIN_PIPELINE_BYTES, Writer

logger = logging.getLogger(__name__)

#: Gets of concurrent lookups run side by side (they share Mooncake's local buffer).
GET_THREADS = 2
#: Frame bytes per direct-get window: the next window moves while this one is checked
#: (a larger batch keeps Mooncake's transfer parallelism; 32, 64 and 128 MiB windows
#: measured alike within this machine's noise, 0.7-1.1 of the own client).
PIPELINE_BYTES = 128 << 20
#: Everything a call can fail with at run time: a miss or a dropped write.
FAULTS: tuple[type[BaseException], ...] = (MooncakeError, TierClosed, OSError)


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    api_version = "2.0"
    Options = MooncakeOptions

    options: MooncakeOptions

    def __init__(self, options: OptionsArg = None, context: BackendContext | None = None) -> None:
        super().__init__(options, context)
        options, context = self.options, self.context
        serializer = context.serializer
        if serializer is None:
            raise ValueError("the mooncake tier needs a serializer")
        self._serializer = serializer
        # An etcd or HTTP address may carry credentials: never printed.
        secrets = [*secrets_in(options.master_address), *secrets_in(options.metadata_server)]
        self.where = (f"mooncake_client {options.client_address}" if options.client_address
                      else f"master {Redactor(secrets)(options.master_address)}")
        self.faults = remote_faults(
            self.counters, f"mooncake tier ({self.where})", options, absorbed=FAULTS,
            unreachable=(MasterUnreachable,), longest_backoff_s=4 * options.retry_after_s,
            secrets=secrets, log=logger)
        # Registered staging: frame headers, and chunks from unregistered memory.
        # With a real client, the shared memory handed to it, known once set up.
        self.staging: MemoryAllocator | None = None if options.client_address else \
            MemoryAllocator(int(options.local_buffer_size), pin_memory=False)
        self._pins: PinTable[None] = PinTable()
        self._close_lock = threading.Lock()
        self._closing = False
        self._frame_hint = 0  # the largest frame seen: sizes get windows
        # The layout of the last frame read (direct gets guess the next from it).
        # (Not with a real client: it cannot write into lmkv's arena.)
        self._direct = bool(serializer.raw_payload and context.allocate is not None
                            and not options.client_address)
        self._layout: Layout | None = None
        self.direct_gets = 0  # chunks read straight into the arena
        self.quarantined_chunks = 0  # arena buffers a failed transfer may still write into
        try:
            self.link = Link(options, self.faults, on_setup=self._registered_staging)
        except MixedClients as exc:
            raise ConfigError(f"config key 'tiers.{context.tier_index}.options.client_address'"
                              f": {exc}") from None
        self.registered = self.link.registered
        atexit.register(self.link.close)  # an engine that exits unmounts its segment
        self._writer = Writer(self.link, serializer, self.staging, self.registered,
                              self.store_key)
        self._gets = PrefixGets(self.faults, GET_THREADS, "lmkv-mooncake-get")
        # Transfers of gets, one window ahead of each get's checks.
        self._fetches = ThreadPoolExecutor(max_workers=GET_THREADS,
                                           thread_name_prefix="lmkv-mooncake-fetch",
                                           initializer=apply_affinity)
        if not self.link.wait_ready(options.connect_timeout_s):
            # The one line a start without the store says; setup goes on in the background.
            silent = self.link.silent
            logger.warning("lmkv mooncake tier: %s after %gs (connect_timeout_s); answering "
                           "misses until it does", f"{silent} does not answer" if silent
                           else f"{self.where} is not set up", options.connect_timeout_s)

    def _registered_staging(self, store: Any) -> None:
        if self.staging is None:  # a real client's: its tiers share the staging
            self.staging = self._writer.staging = self.link.shared_staging
            return
        arena = self.staging.arena
        self.registered.register(store, arena.data_ptr(), arena.numel())

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.where}, protocol={self.options.protocol})"

    def store_key(self, key: CacheKey) -> str:
        return self.options.store_key(key)

    # -- lookups ------------------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return self.batched_async_contains("", [key], pin=pin) == 1

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        """One ``batch_is_exist`` for all of ``keys``: the leading run of hits."""
        if not keys:
            return 0
        names = [self.store_key(k) for k in keys]
        hits = 0
        with self.faults.guard("lookup", "answering misses"):
            with self.link.using() as store:
                codes = self.link.call("batch_is_exist", store.batch_is_exist, names)
            for code in codes:
                if code != 1:
                    raise_for("batch_is_exist", code)
                    break
                hits += 1
            self.faults.succeeded()
        if pin and hits:
            self._pins.pin(names[:hits])
        return hits

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        """Release one pin of this process; False when it held none on ``key``."""
        return self._pins.unpin(self.store_key(key))

    # -- gets -----------------------------------------------------------------------
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        objs = self._gets.read_prefix([key], self._read)
        return objs[0] if objs else None

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        return self._gets.submit(keys, self._read)

    def _window(self) -> int:
        """Keys per ``batch_get_buffer``: what fits in this thread's share of
        Mooncake's local buffer, by the largest frame seen (one key until a
        frame was seen: a batch larger than the buffer would fail whole)."""
        if not self._frame_hint:
            return 1
        share = int(self.options.local_buffer_size) // GET_THREADS
        return max(1, share // self._frame_hint)

    def _read(self, keys: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        """The leading entries found, decoded window by window into ``out``
        (under the fault policy: ``PrefixGets.read_prefix``)."""
        with self.link.using() as store:
            if self.options.client_address:
                self._read_thin(store, keys, out)
                return
            start = 0
            if self._layout is not None:
                start, why = self._read_direct(store, keys, out)
                if why != OTHER_LAYOUT:
                    start = len(keys)  # all read, or the prefix ended
            if start < len(keys):
                self._read_staged(store, keys, start, out)

    def _fetch_ahead(self, fetch: Any, *args: Any) -> Future:
        """``fetch(*args)`` on a fetch thread (the next window, while this one is
        checked)."""
        try:
            return self._fetches.submit(fetch, *args)
        except RuntimeError:  # shut down: the tier is closing
            raise TierClosed("the mooncake tier is closed") from None

    def _read_thin(self, store: Any, keys: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        """Gets of a thin client: frames land in this process's shared staging
        (never in Mooncake's buffers, whose handles release themselves with a call
        to the real client that no timeout bounds), are checked there and copied
        into lmkv's arena. Window by window as for direct gets once a frame's
        layout is known; a frame of another layout is read alone, by its size."""
        start = 0
        while start < len(keys):
            if self._layout is not None:
                got, why = self._read_direct(store, keys[start:], out, thin=True)
                start += got
                if why != OTHER_LAYOUT or start == len(keys):
                    return
            if not self._read_thin_one(store, keys[start], out):
                return
            start += 1

    def _read_thin_one(self, store: Any, key: CacheKey, out: list[MemoryObj]) -> bool:
        """One frame by its size (``get_size``, then ``batch_get_into`` the shared
        staging), decoded into the arena; its layout is the one guessed next.
        False when absent, gone meanwhile, corrupt or without room."""
        assert self.staging is not None
        name = self.store_key(key)
        size = self.link.call("get_size", store.get_size, name)
        if size in NOT_THERE:
            return False
        raise_for("get_size", size)
        block = self.staging.allocate((size,), torch.uint8)
        if block is None:
            return False
        try:
            codes = self.link.call("batch_get_into", store.batch_get_into, [name],
                                   [block.tensor.data_ptr()], [size])
        except BaseException:  # past call_timeout_s: it may still write into the block
            self._quarantine([block])
            raise
        try:
            # An answer of the real client means its copy is over, failed or not.
            if codes[0] not in NOT_THERE:
                raise_for("batch_get_into", codes[0])
            if codes[0] != size:  # absent, or replaced by another size meanwhile
                return False
            frame = block.tensor.numpy().data
            obj = self.decode_frame(key, frame)
            if obj is None:
                return False
            if self._serializer.raw_payload:
                self._layout = Layout.of(read_header(frame, key))
            self.counters.bytes_out += size
            out.append(obj)
            return True
        finally:
            block.ref_down()

    def _read_direct(self, store: Any, keys: Sequence[CacheKey], out: list[MemoryObj],
                     thin: bool = False) -> tuple[int, str]:
        """Direct gets (``direct``), window by window: the next window's transfer
        runs while this one's frames are checked (Mooncake releases the GIL), so
        the checksums cost no extra time. ``thin``: into the shared staging, each
        frame then copied into the arena (``_read_thin``). Returns how many were
        read and why it stopped."""
        layout = self._layout
        staging = self.staging
        allocate = staging.allocate if thin and staging else self.context.allocate
        assert layout is not None and allocate is not None and staging is not None
        frame = layout.header_len + layout.payload_len
        buffer = int(self.options.local_buffer_size)
        # Thin: the frames come from the staging the puts of every tier share too;
        # a get thread holds at most two windows of a quarter of its share.
        window_bytes = min(THIN_PIPELINE_BYTES, buffer // (4 * GET_THREADS)) if thin \
            else PIPELINE_BYTES
        # (Counted in payload bytes: 4 chunks of 32 MiB are one 128 MiB window.)
        size = max(1, min(window_bytes // (frame if thin else layout.payload_len),
                          buffer // 2 // layout.header_len))

        def fetch_window(window: Sequence[CacheKey]) -> Fetched:
            names = [self.store_key(k) for k in window]
            if not thin and has_sessions(store) and self.link.claim_sessions(names):
                try:
                    return fetch_ranged(store, names, window, layout, allocate, staging,
                                        self.registered, self.link.registers_arena,
                                        self._quarantine, self.link)
                finally:
                    self.link.release_sessions(names)
            return fetch(store, names, window, layout, allocate, staging,
                         self.registered, self.link.registers_arena, self._quarantine,
                         self.link.call, answered_is_over=thin)

        read, why = 0, FOUND

        def take(window: Sequence[CacheKey], fetched: Fetched) -> bool:
            nonlocal read, why
            if thin:
                copies, why = self._copied_out(fetched, layout)
                out.extend(copies)
                got = len(copies)
            else:
                got, why = settle(fetched, layout, out)
                self.direct_gets += got
            read += got
            self.counters.bytes_out += got * frame
            return why == FOUND

        read_windows(keys, lambda: size, fetch_window, take,
                     ahead=lambda window: self._fetch_ahead(fetch_window, window),
                     release=Fetched.release)
        if why == FOUND:
            self.faults.succeeded()
        return read, why

    def _copied_out(self, fetched: Fetched, layout: Layout) -> tuple[list[MemoryObj], str]:
        """``settle`` a thin window (frames checked in the shared staging), then
        copy each good frame into a buffer of lmkv's arena: the leading ones
        there was room for, and why it stopped."""
        staged: list[MemoryObj] = []
        copies: list[MemoryObj] = []
        try:
            # (Frames settle hands over before it raises for a later one are
            # given back below too.)
            _, why = settle(fetched, layout, staged)
            for obj in staged:
                copy = self.context.allocate(layout.shape, layout.dtype) \
                    if self.context.allocate is not None else None
                if copy is None:
                    return copies, ABSENT  # no room: the rest is a miss
                # numpy, not torch: torch's copy of a large tensor runs on its
                # OpenMP threads, which in vLLM's CPU build are the forward's.
                copy.byte_view().numpy()[:] = obj.byte_view().numpy()
                copies.append(copy)
        finally:
            for obj in staged:
                obj.ref_down()
        return copies, why

    def _quarantine(self, objs: list[MemoryObj]) -> None:
        """Keep the buffers of a failed direct get out of the arena (``Link.quarantine``)."""
        self.link.quarantine(objs)
        thin = bool(self.options.client_address)  # (its chunks land in the staging)
        chunks = sum(1 for obj in objs if thin or obj.allocator is not self.staging)
        self.quarantined_chunks += chunks
        self.faults.note("quarantine", "a failed get may still write into %d chunk buffers "
                         "and %d staging blocks: kept out of use until the store is closed",
                         chunks, len(objs) - chunks)

    def _read_staged(self, store: Any, keys: Sequence[CacheKey], start: int,
                     out: list[MemoryObj]) -> None:
        """Staged gets of ``keys[start:]``, window by window, until one is missing.
        Once a frame was seen, a window is half this thread's share of Mooncake's
        local buffer and the next one moves while this one is checked and decoded
        (the transfer engine, or the real client, copies while this thread hashes)."""
        def fetch_window(window: Sequence[CacheKey]) -> Any:
            return self.link.call("batch_get_buffer", store.batch_get_buffer,
                                  [self.store_key(k) for k in window])

        def size() -> int:
            return max(1, self._window() // 2) if self._frame_hint else 1

        def ahead(window: Sequence[CacheKey]) -> Future | None:
            # Until a frame was seen, one key at a time and nothing ahead: a batch
            # larger than the buffer would fail whole. (Handles fetched past where
            # the read stopped give the buffer back when dropped.)
            return self._fetch_ahead(fetch_window, window) if self._frame_hint else None

        read_windows(keys[start:], size, fetch_window,
                     lambda window, handles: self._get_window(store, window, out, handles),
                     ahead=ahead)

    def _get_window(self, store: Any, keys: Sequence[CacheKey], out: list[MemoryObj],
                    handles: Any) -> bool:
        """Decode the frames of ``keys`` (``handles``: one ``batch_get_buffer``'s
        answer) into ``out``; False at the first that is absent or not a valid frame
        (a corrupt one is dropped)."""
        try:
            for key, handle in zip(keys, handles, strict=True):
                if handle is None:  # absent, evicted, or its get failed
                    self._why_missing(store, key)
                    return False
                size = handle.size()
                self._frame_hint = max(self._frame_hint, size)
                frame = memoryview((ctypes.c_ubyte * size).from_address(handle.ptr())).cast("B")
                obj = self.decode_frame(key, frame)
                if obj is None:
                    return False
                if self._direct:
                    self._layout = Layout.of(read_header(frame, key))
                self.counters.bytes_out += size
                out.append(obj)
            self.faults.succeeded()
            return True
        finally:
            del handles  # gives Mooncake's local buffer back

    def _why_missing(self, store: Any, key: CacheKey) -> None:
        """``batch_get_buffer`` answers None for an absent entry and for a failed
        get alike: ask whether the entry exists (one call, at the end of a read
        only). Raises the tier's fault for a failure: unreachable (the breaker
        opens) when the master does not answer, else a counted error."""
        code = self.link.call("is_exist", store.is_exist, self.store_key(key))
        raise_for("is_exist", code)
        if code == 1:
            raise MooncakeError("batch_get_buffer", -1, "batch_get_buffer failed for an entry "
                                "that exists (see Mooncake's log)")

    # -- puts -----------------------------------------------------------------------
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        # The store evicts by its own policy: parents are not used here.
        return self._writer.submit(list(keys), list(objs))

    # -- removal --------------------------------------------------------------------
    def remove(self, key: CacheKey) -> bool:
        """Delete ``key`` from the pool, pinned or not (pins are local), leased or
        not (a corrupt entry must go even while another reader holds it)."""
        name = self.store_key(key)
        removed = False
        with self.faults.guard("remove", "entry left in place"):
            with self.link.using() as store:
                size = self.link.call("get_size", store.get_size, name)
                code = self.link.call("remove", store.remove, name, True)
            if code == OBJECT_NOT_FOUND:
                return False
            raise_for("remove", code)
            removed = True
            if size > 0:
                self._writer.forget(size)
        return removed

    # -- figures --------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """Frame bytes this process added to the pool (new entries it wrote, less
        entries it removed). Blind to the store's eviction and other processes."""
        return max(0, self._writer.net_bytes)

    def stats(self) -> dict[str, int | None]:
        return {**super().stats(), "pinned_keys": len(self._pins),
                "pending_put_bytes": self._writer.pending_bytes,
                "zero_copy_put_bytes": self._writer.zero_copy_bytes,
                "direct_gets": self.direct_gets,
                "quarantined_chunks": self.quarantined_chunks}

    def close(self) -> None:
        """Wait up to ``close_timeout_s`` for puts in flight, then drop the rest and
        start unmounting this process's segment (``client.join_closing`` waits for
        that; it runs at interpreter exit too); returns promptly even when the
        master is gone."""
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self._writer.close(self.options.close_timeout_s)
        self._gets.close()
        self._fetches.shutdown(wait=False)
        staging = self.staging
        if staging is not None and not self.link.closed and not self.options.client_address:
            # (Closed at interpreter exit already: the store is going. A thin
            # client's staging is shared and kept with its client.)
            # Whatever the breaker says: memory left registered and then freed
            # would make Mooncake refuse a later buffer at an overlapping address.
            with self.faults.guard("close", "staging left registered"), \
                    self.link.using(breaker=False) as store:
                self.registered.unregister(store, staging.arena.data_ptr())
        self.faults.close()
        self.link.close()
        atexit.unregister(self.link.close)
        self._pins.clear()
        super().close()
