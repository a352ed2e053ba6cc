"""Puts of the mooncake tier: asynchronous, one batched call per window.

``submit`` (``lmkv.contracts.put_queue.PutQueue``) takes a reference on every MemoryObj
and returns at once; a background thread asks the master which entries already exist (one
``batch_is_exist``: another engine may have stored them, and nothing is sent
twice), frames the rest and stores a window of them with one
``batch_put_from_multi_buffers``: each frame goes as its header (copied into
the tier's registered staging arena) and its payload read in place from lmkv's
arena when that is registered (else copied into staging too). The future
resolves to the number of entries stored (already present counts) and never
raises for a Mooncake fault.

Where the store has put sessions (Mooncake's ranged calls) and every chunk lies
in registered memory under a raw-payload serializer, a window goes through one
instead (``_send_session``), with no ``batch_is_exist`` first:
``batch_put_session_start`` reserves its entries (and answers
OBJECT_ALREADY_EXISTS for those already there), the payloads start moving from
lmkv's arena at once, and this thread computes the headers (the checksums)
meanwhile; the headers move as soon as they are computed, and
``batch_put_session_end`` makes the entries readable. An entry whose payload or
header did not arrive whole is revoked, never ended: nothing half written is
ever readable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lmkv.contracts import CacheKey, MemoryAllocator, MemoryObj, PutQueue, Serializer, header_len
from lmkv_mooncake.client import (
    BUFFER_TOO_SMALL,
    INVALID_WRITE,
    OBJECT_ALREADY_EXISTS,
    Link,
    MooncakeError,
    raise_for,
    replicate_config,
    unreachable,
)
from lmkv_mooncake.memory import Registered, address

logger = logging.getLogger(__name__)

#: Frame bytes per batched put: the next window is framed while this one is sent
#: (a larger batch keeps Mooncake's transfer parallelism; 32, 64 and 128 MiB windows
#: measured alike within this machine's noise, 0.7-1.1 of the own client).
PIPELINE_BYTES = 128 << 20
#: The same through a real client: the transfer is a copy by the real client's
#: process, so small windows let this thread frame (copy into the shared staging,
#: checksum) the next chunks while it copies these.
THIN_PIPELINE_BYTES = 16 << 20


def _payload_len(obj: MemoryObj) -> int:
    """The chunk's own bytes (``obj.nbytes`` is its arena block, rounded up)."""
    return obj.tensor.numel() * obj.tensor.element_size()


class _Window:
    """Frames of one batched put: names, buffer lists and the staging they use."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.frame_lens: list[int] = []
        self.staging: list[MemoryObj] = []
        self.nbytes = 0

    def release(self) -> None:
        for obj in self.staging:
            obj.ref_down()
        self.staging.clear()


@dataclass
class _Revoked:
    """What ``Writer._revoke`` found: ``left``, the sessions that may still be
    open (the master did not answer), each with whether its end may have
    reached the master; ``ended``, the entries readable after all (an end that
    went through, its answer lost); ``absent``, the names no session of this
    client held."""

    left: dict[str, bool] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    absent: set[str] = field(default_factory=set)


class Writer(PutQueue):
    def __init__(self, link: Link, serializer: Serializer, staging: MemoryAllocator | None,
                 registered: Registered, name_of: Any) -> None:
        super().__init__(link.faults, link.options.max_pending_bytes, "lmkv-mooncake-put")
        self.link = link
        self.options = link.options
        self.serializer = serializer
        self.staging = staging
        self.registered = registered
        self.name_of = name_of
        self._config: Any = None
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmkv-mooncake-send")
        self.zero_copy_bytes = 0  # payload bytes read in place (no staging copy)
        self._window_bytes = THIN_PIPELINE_BYTES if self.options.client_address \
            else PIPELINE_BYTES

    @property
    def usable(self) -> bool:
        return self.link.usable

    # -- writing (background thread) ------------------------------------------------
    def _write(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        done = [0, 0]  # entries stored, entries settled (stored or counted as dropped)
        with self.faults.guard("put", "dropping the batch's remaining writes"):
            self._write_all(keys, objs, done)
        self.counters.dropped_writes += len(keys) - done[1]
        self.counters.puts += done[0]
        return done[0]

    def _write_all(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                   done: list[int]) -> None:
        with self.link.using() as store:
            self._write_to(store, keys, objs, done)

    def _write_to(self, store: Any, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                  done: list[int]) -> None:
        """Frame window after window while the previous window is on the wire
        (Mooncake's calls release the GIL): the checksums cost no extra time."""
        names = [self.name_of(k) for k in keys]
        if self._sessions_fit(store, objs):
            self._write_sessions(store, names, keys, objs, done)
            return
        present = self.link.call("batch_is_exist", store.batch_is_exist, names)
        for code in present:
            raise_for("batch_is_exist", code)
        self.faults.succeeded()
        done[0] = done[1] = sum(1 for code in present if code == 1)
        window = _Window()
        sending: Future | None = None

        def send() -> None:
            nonlocal window, sending
            if sending is not None:
                previous, sending = sending, None
                previous.result()  # one window on the wire at a time; raises its fault
            if window.names:
                sending = self._sender.submit(self._flush, store, window, done)
                window = _Window()

        try:
            for i, code in enumerate(present):
                if code == 1:
                    continue
                if window.nbytes >= self._window_bytes:
                    send()
                if self._add(store, window, names[i], keys[i], objs[i]):
                    continue
                send()  # staging full: send what we have, wait for the window before
                if sending is not None:
                    previous, sending = sending, None
                    previous.result()
                if self._add(store, window, names[i], keys[i], objs[i]):
                    continue
                done[1] += 1
                self.counters.dropped_writes += 1
                self.faults.note("too-large", "the frame of %s found no room in the staging "
                                 "buffer (local_buffer_size must hold the largest frame, and "
                                 "the writes in flight of every tier sharing it); dropped",
                                 names[i])
            send()
            send()
        finally:
            if sending is not None:
                wait([sending])  # its staging is released by _flush itself
            window.release()

    def _write_sessions(self, store: Any, names: list[str], keys: Sequence[CacheKey],
                        objs: Sequence[MemoryObj], done: list[int]) -> None:
        """Store the batch through put sessions, a window at a time. No
        ``batch_is_exist`` first: a start answers OBJECT_ALREADY_EXISTS for an
        entry already there (or being written by another engine), and nothing
        of it is sent. A key twice in the batch is sent once; its copies count
        as that entry turned out."""
        self._settle_unsettled(store)
        first = {name: i for i, name in reversed(list(enumerate(names)))}
        todo = sorted(first.values())
        stored: set[str] = set()
        try:
            start = 0
            while start < len(todo):
                end, nbytes = start, 0
                while end < len(todo) and (end == start or nbytes < self._window_bytes):
                    nbytes += objs[todo[end]].nbytes
                    end += 1
                self._send_session(store, [names[i] for i in todo[start:end]],
                                   [keys[i] for i in todo[start:end]],
                                   [objs[i] for i in todo[start:end]], done, stored)
                start = end
        finally:
            copies = [name for i, name in enumerate(names) if first[name] != i]
            kept = sum(name in stored for name in copies)
            done[0] += kept
            done[1] += len(copies)
            self.counters.dropped_writes += len(copies) - kept

    def _sessions_fit(self, store: Any, objs: Sequence[MemoryObj]) -> bool:
        """Whether these chunks can go through put sessions: the store has them,
        the serializer writes raw payloads, and every chunk lies contiguous in
        memory registered with the store (lmkv's arena)."""
        if not (objs and self.serializer.raw_payload and self.link.registers_arena
                and hasattr(store, "batch_put_session_start")
                and hasattr(store, "batch_put_from_multi_buffer_ranges")):
            return False
        for obj in objs:
            if obj.allocator is None or obj.allocator is self.staging \
                    or not obj.tensor.is_contiguous():
                return False
            arena = obj.allocator.arena
            self.registered.register(store, arena.data_ptr(), arena.numel())
            if not self.registered.covers(obj.tensor.data_ptr(), _payload_len(obj)):
                return False
        return True

    def _send_session(self, store: Any, names: list[str], keys: Sequence[CacheKey],
                      objs: Sequence[MemoryObj], done: list[int], stored: set[str]) -> None:
        """Store one window through a put session (see the module's doc);
        ``stored`` gets the names stored (or already there). A refused entry is
        a counted fault, a master out of reach raises (the batch's remaining
        writes are dropped)."""
        mine: set[str] = set()
        unsettled: dict[str, bool] = {}
        try:
            mine = self.link.claim_puts(names)
            busy = sum(name not in mine for name in names)  # another writer of this
            done[1] += busy  # process is putting them: not touched here
            self.counters.dropped_writes += busy
            keep = [i for i, name in enumerate(names) if name in mine]
            if keep:
                self._send_claimed(store, [names[i] for i in keep], [keys[i] for i in keep],
                                   [objs[i] for i in keep], done, unsettled, stored)
        finally:
            self.link.release_puts(mine, unsettled)

    def _send_claimed(self, store: Any, names: list[str], keys: Sequence[CacheKey],
                      objs: Sequence[MemoryObj], done: list[int],
                      unsettled: dict[str, bool], stored: set[str]) -> None:
        """``_send_session`` of claimed ``names``; ``unsettled`` gets the names
        whose put session may still be open in Mooncake (revoked before a later
        put), each with whether its end may have reached the master."""
        if self._config is None:
            self._config = replicate_config(self.options)
        hlens = [header_len(obj.tensor.dim()) for obj in objs]
        plens = [_payload_len(obj) for obj in objs]
        staging = self.staging  # None until the link is set up: no room yet
        block = staging.allocate((sum(hlens),), torch.uint8) if staging is not None else None
        if block is None:
            done[1] += len(names)
            self.counters.dropped_writes += len(names)
            self.faults.note("too-large", "the headers of %d frames found no room in the "
                             "staging buffer (local_buffer_size must hold them, and the writes "
                             "in flight of every tier sharing it); dropped", len(names))
            return
        opened: list[int] = []
        stale: list[int] = []  # a session of the key an earlier call left open
        ended: set[int] = set()
        end_sent: set[int] = set()
        try:
            try:
                codes = self.link.call("batch_put_session_start",
                                       store.batch_put_session_start, names,
                                       [h + p for h, p in zip(hlens, plens, strict=True)],
                                       self._config)
            except BaseException:
                # It may still open them, after this answer: revoked before a later put.
                unsettled.update(dict.fromkeys(names, False))
                raise
            opened = [i for i, code in enumerate(codes) if code == 0]
            if not any(unreachable(code) for code in codes):
                self.faults.succeeded()  # the master answered
            unreachable_code = None
            for i, code in enumerate(codes):
                if code == 0:
                    continue
                done[1] += 1
                if code == OBJECT_ALREADY_EXISTS:  # another writer got there first
                    done[0] += 1
                    stored.add(names[i])
                    continue
                self.counters.dropped_writes += 1
                if code == BUFFER_TOO_SMALL:  # INVALID_PARAMS: a session left open, or
                    stale.append(i)  # parameters refused (told apart by its revoke)
                elif unreachable(code):
                    unreachable_code = unreachable_code or code
                else:
                    self.faults.fault("put", MooncakeError("put", code), "write dropped",
                                      names[i])
            if unreachable_code is not None:
                raise_for("batch_put_session_start", unreachable_code)
            if opened:
                self._send_opened(store, names, keys, objs, hlens, plens, block, opened,
                                  ended, end_sent)
        finally:
            block.ref_down()  # (a late transfer reads it only into entries never ended)
            # Reserved, never readable: give the space back.
            revoked = self._revoke(store, [names[i] for i in opened + stale if i not in ended],
                                   {names[i] for i in end_sent})
            unsettled.update(revoked.left)
            stored.update(self._count_opened(names, hlens, plens, opened, ended, revoked,
                                             done))
            refused = [names[i] for i in stale if names[i] in revoked.absent]
            if refused:  # no session of ours held them: the start refused its parameters
                self.faults.fault("put", MooncakeError("put", BUFFER_TOO_SMALL),
                                  f"{len(refused)} writes dropped", refused[0])
            if len(stale) > len(refused):
                self.faults.note("session-put", "%d writes found a put session of theirs "
                                 "left open by an earlier call; dropped, the session revoked "
                                 "where Mooncake let it (see its log)", len(stale) - len(refused))

    def _count_opened(self, names: list[str], hlens: list[int], plens: list[int],
                      opened: list[int], ended: set[int], revoked: _Revoked,
                      done: list[int]) -> list[str]:
        """Count the entries whose put session opened: stored when ended (by
        ``_send_opened``, or again by ``_revoke``), else dropped; returns the
        names stored."""
        stored = [i for i in opened if i in ended or names[i] in revoked.ended]
        done[0] += len(stored)
        done[1] += len(opened)
        self.counters.dropped_writes += len(opened) - len(stored)
        nbytes = sum(hlens[i] + plens[i] for i in stored)
        self.counters.bytes_in += nbytes
        self.zero_copy_bytes += sum(plens[i] for i in stored)
        with self._lock:
            self.net_bytes += nbytes
        if len(stored) < len(opened):
            self.faults.note("session-put", "%d of %d writes did not arrive whole "
                             "through a put session (see Mooncake's log); revoked",
                             len(opened) - len(stored), len(opened))
        return [names[i] for i in stored]

    def _send_opened(self, store: Any, names: list[str], keys: Sequence[CacheKey],
                     objs: Sequence[MemoryObj], hlens: list[int], plens: list[int],
                     block: MemoryObj, opened: list[int], ended: set[int],
                     end_sent: set[int]) -> None:
        """Move the ``opened`` entries' payloads and headers and end their
        sessions; ``ended`` gets those that are readable now, ``end_sent`` those
        whose end was asked for."""
        ranges = store.batch_put_from_multi_buffer_ranges
        payloads = self.link.start(
            "batch_put_from_multi_buffer_ranges", ranges, [names[i] for i in opened],
            [[objs[i].tensor.data_ptr()] for i in opened], [[plens[i]] for i in opened],
            [[hlens[i]] for i in opened])
        # While the payloads move: the headers (each a checksum of its payload).
        framed: dict[int, int] = {}  # entry -> its header's offset in the block
        offset = 0
        for i in opened:
            header, *payload = self.serializer.serialize(objs[i], keys[i])
            if len(header) != hlens[i] or [address(b) for b in payload] != [
                    (objs[i].tensor.data_ptr(), plens[i])]:
                continue  # not header + the chunk's own bytes: revoked
            block.tensor.numpy()[offset:offset + hlens[i]] = np.frombuffer(
                header, dtype=np.uint8)
            framed[i] = offset
            offset += hlens[i]
        # The headers move while the payloads may still (disjoint ranges of the
        # same sessions: Mooncake ends a session only once its writes are over).
        framing = [i for i in opened if i in framed]
        base = block.tensor.data_ptr()
        heads = self.link.start(
            "batch_put_from_multi_buffer_ranges", ranges, [names[i] for i in framing],
            [[base + framed[i]] for i in framing], [[hlens[i]] for i in framing],
            [[0]] * len(framing)) if framing else (lambda: [])
        moved = dict(zip(opened, payloads(), strict=True))
        headed = dict(zip(framing, heads(), strict=True))
        whole = [i for i in framing if moved[i] == plens[i] and headed[i] == hlens[i]]
        if whole:
            end_sent.update(whole)
            sealed = self.link.call("batch_put_session_end", store.batch_put_session_end,
                                    [names[i] for i in whole])
            ended.update(i for i, code in zip(whole, sealed, strict=True) if code == 0)

    def _settle_unsettled(self, store: Any) -> None:
        """Revoke the put sessions failed calls left open (any writer's of this
        process): until revoked, Mooncake refuses every later session of the key.
        (An entry ended here was counted as dropped by its own batch.)"""
        pending = self.link.take_unsettled()
        if pending:
            left = pending
            try:
                # A master out of reach raises here: the put's guard tells the breaker.
                left = self._revoke(store, list(pending),
                                    {name for name, sent in pending.items() if sent},
                                    reraise=True).left
            finally:
                self.link.release_puts(pending, left)

    def _revoke(self, store: Any, names: list[str], end_sent: set[str],
                reraise: bool = False) -> _Revoked:
        """Revoke the put sessions of ``names`` (see ``_Revoked``). An entry
        whose end was asked for (``end_sent``) and that the master holds whole
        (the end reached it, its answer did not reach us: only whole entries
        are ever ended) refuses the revoke with INVALID_WRITE: it is ended
        again instead. Any other refusal leaves the session to Mooncake: a
        later start of the key answers INVALID_PARAMS, which brings it back
        here. A call that fails (the master out of reach) leaves every name it
        asked about in ``left``, and raises with ``reraise`` (else the caller's
        own failure, if any, tells the breaker)."""
        revoked = _Revoked()
        if not names:
            return revoked
        try:
            codes = self.link.call("batch_put_session_revoke", store.batch_put_session_revoke,
                                   names)
        except Exception:
            revoked.left = {name: name in end_sent for name in names}
            if reraise:
                raise
            return revoked
        whole = []
        for name, code in zip(names, codes, strict=True):
            if code == INVALID_WRITE and name in end_sent:
                whole.append(name)
            elif code == BUFFER_TOO_SMALL:  # INVALID_PARAMS: no session of ours
                (revoked.ended if name in end_sent else revoked.absent).add(name)
            elif unreachable(code):
                revoked.left[name] = name in end_sent
        if whole:
            try:
                codes = self.link.call("batch_put_session_end", store.batch_put_session_end,
                                       whole)
            except Exception:
                revoked.left.update(dict.fromkeys(whole, True))
                if reraise:
                    raise
                return revoked
            for name, code in zip(whole, codes, strict=True):
                if code in (0, BUFFER_TOO_SMALL):  # (INVALID_PARAMS: the first end,
                    revoked.ended.add(name)  # late, went through and closed it)
                elif unreachable(code):
                    revoked.left[name] = True
        return revoked

    def _add(self, store: Any, window: _Window, name: str, key: CacheKey,
             obj: MemoryObj) -> bool:
        """Frame ``obj`` into ``window``; False when staging has no room for it."""
        if self.link.registers_arena and obj.allocator is not None \
                and obj.allocator is not self.staging:
            arena = obj.allocator.arena
            self.registered.register(store, arena.data_ptr(), arena.numel())
        buffers = [(b, *address(b)) for b in self.serializer.serialize(obj, key)]
        buffers = [(b, p, n) for b, p, n in buffers if n]
        copied = sum(n for _, p, n in buffers if not self.registered.covers(p, n))
        block = None
        if copied:
            staging = self.staging  # None until the link is set up: no room yet
            block = staging.allocate((copied,), torch.uint8) if staging is not None else None
            if block is None:
                return False
            window.staging.append(block)
            base = block.tensor.data_ptr()
            dest = block.tensor.numpy()
        ptrs, sizes, offset = [], [], 0
        for buffer, ptr, nbytes in buffers:
            if block is not None and not self.registered.covers(ptr, nbytes):
                dest[offset:offset + nbytes] = np.frombuffer(buffer, dtype=np.uint8)
                ptrs.append(base + offset)
                offset += nbytes
            else:
                ptrs.append(ptr)
                self.zero_copy_bytes += nbytes
            sizes.append(nbytes)
        window.names.append(name)
        window.ptrs.append(ptrs)
        window.sizes.append(sizes)
        window.frame_lens.append(sum(sizes))
        window.nbytes += sum(sizes)
        return True

    def _flush(self, store: Any, window: _Window, done: list[int]) -> None:
        """Store the window's frames; a refused entry is a counted fault, a master
        out of reach raises (the batch's remaining writes are dropped)."""
        if self._config is None:
            self._config = replicate_config(self.options)
        try:
            # A put that timed out may still read its buffers after they are
            # reused: what it stores then fails its checksums (a miss, removed).
            codes = self.link.call("batch_put_from_multi_buffers",
                                   store.batch_put_from_multi_buffers, window.names,
                                   window.ptrs, window.sizes, self._config)
        finally:
            window.release()
        failed = None
        for name, frame_len, code in zip(window.names, window.frame_lens, codes, strict=True):
            done[1] += 1
            if code >= 0:
                done[0] += 1
                self.counters.bytes_in += frame_len
                with self._lock:
                    self.net_bytes += frame_len
            elif code == OBJECT_ALREADY_EXISTS:  # another writer got there first
                done[0] += 1
            elif unreachable(code):
                self.counters.dropped_writes += 1
                failed = failed or code
            else:  # refused (no space, ...): that entry is dropped, the rest go on
                self.counters.dropped_writes += 1
                self.faults.fault("put", MooncakeError("put", code), "write dropped", name)
        window.names, window.ptrs, window.sizes, window.frame_lens = [], [], [], []
        if failed is not None:
            raise_for("batch_put_from_multi_buffers", failed)

    def close(self, timeout_s: float) -> None:
        super().close(timeout_s)
        self._sender.shutdown(wait=False)
