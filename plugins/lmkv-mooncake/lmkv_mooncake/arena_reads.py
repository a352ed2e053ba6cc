"""Gets straight into lmkv's arena, without a staging copy.

A frame of the ``naive`` serializer (``raw_payload``) is a header and the
chunk's raw bytes. Once the tier has seen one frame, it knows the layout the
next ones most likely have (every chunk of a model has the same shape but the
last): it allocates each chunk's buffer from lmkv's (registered) arena and
asks the store to scatter each frame into [header staging, chunk buffer] with
one ``batch_get_into_multi_buffers``. The header is then checked against the
key and the guessed layout and the payload against its checksum, in place; a
frame that fails those checks is read again the staged way, which drops it
only if it is corrupt by its own length.

Where the store has get sessions (Mooncake's ranged calls), a window is read
with them instead (``fetch_ranged``): one ``batch_get_session_start`` resolves
every key's replica, then each call moves the next piece of every frame while
this thread hashes the pieces the last call moved, so the checksums overlap
the transfer; ``settle`` then compares the digests.

A frame of another size or shape is not a fault: the read stops there and the
rest goes the staged way (``batch_get_buffer``), which learns the new layout.

A window whose call answered anything but a frame, a size mismatch or "not
found" (a transfer or RPC failure) is not given back to the arena: Mooncake
0.3.13 cannot cancel or wait for a transfer, so one may still be writing into
those buffers, and a block reused by another chunk would hold wrong KV. They
are quarantined (``Link.quarantine``) until the store is closed. A thin
client's call (``answered_is_over``) returns only once the real client's copy
is over, so there only a call that did not answer in time quarantines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from lmkv.contracts import (
    Allocate,
    CacheKey,
    CorruptFrameError,
    FrameHeader,
    MemoryAllocator,
    MemoryObj,
    read_header,
    verify_payload,
)
from lmkv_mooncake.client import (
    BUFFER_TOO_SMALL,
    NOT_THERE,
    TRANSFER_FAIL,
    raise_for,
)
from lmkv_mooncake.memory import Registered

#: Frame bytes one ranged get call moves (every key's next piece): small enough
#: that the first pieces are hashed while most of a window still moves, large
#: enough to keep the transfer's parallelism (4 calls per 128 MiB window measured
#: best here; 8 and 32 lost 20-45% to the calls).
RANGE_BYTES = 32 << 20
#: No piece is smaller than this, whatever the window's keys.
MIN_PIECE_BYTES = 1 << 20
#: A window of few keys still moves in this many calls (pieces of a quarter of
#: a frame for one key), so only the last call's pieces are hashed after the
#: transfer: a get of one 32 MiB chunk went from 1.91-2.28 GB/s in one call to
#: 2.37-2.84 GB/s in four (a 16-core host, interleaved runs).
MIN_CALLS = 4


@dataclass(frozen=True)
class Layout:
    """What the last frame read looked like."""

    serializer_id: int
    header_len: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload_len: int

    @classmethod
    def of(cls, header: FrameHeader) -> Layout:
        return cls(header.serializer_id, header.header_len, header.shape, header.dtype,
                   header.payload_len)


#: What a get session answers for an entry it cannot read in place (its lease
#: ran out, no complete memory replica to read from): the staged way tries it
#: (answered by the batch call instead, a failure like any other).
NOT_IN_PLACE = frozenset({-702, -707})  # INVALID_REPLICA, LEASE_EXPIRED

#: Why a direct read stopped.
FOUND, ABSENT, OTHER_LAYOUT = "found", "absent", "other"


def transfer_over(code: int) -> bool:
    """Whether a get that answered ``code`` is known to have stopped writing into
    its buffers: a frame read (its size, whatever it is), too small buffers
    (refused before any transfer) or no readable object (none, or one still being
    written: refused before any transfer too). Every other code is a failed
    transfer or call, which may still be writing."""
    return code >= 0 or code == BUFFER_TOO_SMALL or code in NOT_THERE


@dataclass
class Fetched:
    """One window on its way: fresh arena buffers the store has filled (or
    ``codes`` None: no room or unregistered memory, nothing was asked)."""

    keys: Sequence[CacheKey]
    objs: list[MemoryObj]
    header_block: MemoryObj | None
    codes: list[int] | None
    quarantine: Callable[[list[MemoryObj]], None]
    asked: bool = False  # the store was called (it may have written into the buffers)
    # A thin client's call returns once the real client's copy is over: any code.
    answered_is_over: bool = False
    # Payload digests computed while the frames moved (``fetch_ranged``), else None.
    checksums: list[int] | None = None
    # The leading ``objs`` handed to the caller (``settle``): theirs, not released here.
    handed: int = 0

    @property
    def idle(self) -> bool:
        """Whether the store is known to be done with this window's buffers."""
        if not self.asked:
            return True
        return self.codes is not None and (
            self.answered_is_over or all(transfer_over(c) for c in self.codes))

    def release(self) -> None:
        """Give back every buffer not handed over, or quarantine them when a
        transfer into them may still run (idempotent)."""
        objs = self.objs[self.handed:]
        if self.header_block is not None:
            objs.append(self.header_block)
        self.objs, self.handed, self.header_block = [], 0, None
        if objs and not self.idle:
            self.quarantine(objs)
            return
        for obj in objs:
            obj.ref_down()


def _allocated(fetched: Fetched, layout: Layout, allocate: Allocate, store: Any,
               registered: Registered, register_arena: bool) -> bool:
    """Give ``fetched`` a (registered) arena buffer per key; False when there is no
    room or the memory is not registered (nothing is asked then)."""
    for _ in fetched.keys:
        obj = allocate(layout.shape, layout.dtype)
        if obj is None:
            return False  # no room: the staged way sorts it out
        fetched.objs.append(obj)
    if fetched.header_block is None:
        return False
    arena = fetched.objs[0].allocator
    if arena is not None and register_arena:
        registered.register(store, arena.arena.data_ptr(), arena.arena.numel())
    return all(registered.covers(o.tensor.data_ptr(), layout.payload_len)
               for o in fetched.objs)


def fetch(store: Any, names: Sequence[str], keys: Sequence[CacheKey], layout: Layout,
          allocate: Allocate, staging: MemoryAllocator, registered: Registered,
          register_arena: bool, quarantine: Callable[[list[MemoryObj]], None],
          call: Callable[..., Any], answered_is_over: bool = False) -> Fetched:
    """Allocate ``keys``' buffers and have the store scatter their frames into
    them (one ``batch_get_into_multi_buffers``, through ``call``: ``Link.call``);
    nothing is checked yet."""
    fetched = Fetched(keys, [], staging.allocate((layout.header_len * len(keys),), torch.uint8),
                      None, quarantine, answered_is_over=answered_is_over)
    try:
        block = fetched.header_block
        if block is None or not _allocated(fetched, layout, allocate, store, registered,
                                           register_arena):
            return fetched
        base = block.tensor.data_ptr()
        hlen, plen = layout.header_len, layout.payload_len
        fetched.asked = True
        ptrs = [[base + i * hlen, o.tensor.data_ptr()] for i, o in enumerate(fetched.objs)]
        codes = call("batch_get_into_multi_buffers", store.batch_get_into_multi_buffers,
                     list(names), ptrs, [[hlen, plen]] * len(fetched.objs))
        fetched.codes = _sizes_told_apart(store, call, names, list(codes), hlen + plen)
        return fetched
    except BaseException:
        fetched.release()
        raise


def has_sessions(store: Any) -> bool:
    """Whether ``store`` offers get sessions (ranged reads; Mooncake 0.3.13 on)."""
    return hasattr(store, "batch_get_session_start") and \
        hasattr(store, "batch_get_into_multi_buffer_ranges")


def fetch_ranged(store: Any, names: Sequence[str], keys: Sequence[CacheKey], layout: Layout,
                 allocate: Allocate, staging: MemoryAllocator, registered: Registered,
                 register_arena: bool, quarantine: Callable[[list[MemoryObj]], None],
                 link: Any) -> Fetched:
    """``fetch`` through one get session: the frames move in pieces of at most
    ``RANGE_BYTES`` a call (in ``MIN_CALLS`` calls at least), and each call's
    pieces are hashed while the next call moves. The caller holds the session
    claim on ``names`` (``Link.claim_sessions``).

    Codes as ``fetch`` gives them, the prefix ending at the first key that is
    not a frame of ``layout``'s size: the session's answer for it (absent, ...),
    ``INVALID_PARAMS`` (what a range past a smaller object answers, so
    ``settle`` reads it the staged way) or, for a larger object, its first byte
    past the guess read (one byte: a size ``settle`` does not take). A ranged
    call answers only once its transfer is over, so any answered window is
    idle; a call past ``call_timeout_s`` leaves ``codes`` None (quarantined)."""
    hlen, plen = layout.header_len, layout.payload_len
    fetched = Fetched(keys, [], staging.allocate((hlen * len(keys) + 1,), torch.uint8),
                      None, quarantine, answered_is_over=True)
    ranges = store.batch_get_into_multi_buffer_ranges
    opened = False
    try:
        if fetched.header_block is None:
            return fetched
        base = fetched.header_block.tensor.data_ptr()
        codes = list(link.call("batch_get_session_start", store.batch_get_session_start,
                               list(names)))
        opened = True
        live = _leading(range(len(keys)), lambda i: codes[i] == 0)
        if live:  # a byte past every guessed frame: refused unless the object is larger
            # (into the header block only: a probe that does not answer in time
            # leaves nothing but that block quarantined)
            fetched.asked = True
            past = link.call("batch_get_into_multi_buffer_ranges", ranges,
                             [names[i] for i in live], [[base + hlen * len(keys)]] * len(live),
                             [[1]] * len(live), [[hlen + plen]] * len(live))
            fetched.asked = False  # answered: that transfer is over
            for i, code in zip(live, past, strict=True):
                codes[i] = 0 if code == BUFFER_TOO_SMALL else (
                    hlen + plen + 1 if code >= 0 else code)
            live = _leading(live, lambda i: codes[i] == 0)
        if live and not _allocated(fetched, layout, allocate, store, registered,
                                   register_arena):
            return fetched  # codes None: the staged way reads them
        fetched.asked = bool(live)  # from here a call may write into the buffers
        piece = max(MIN_PIECE_BYTES, min(RANGE_BYTES // max(1, len(live)),
                                         -(-plen // MIN_CALLS)))
        bounds = [(a, min(a + piece, plen)) for a in range(0, plen, piece)]
        hashers = {i: xxhash.xxh3_64() for i in live}

        def ask(k: int, which: list[int]) -> Callable[[], Any]:
            a, b = bounds[k]
            ptrs = [[fetched.objs[i].tensor.data_ptr() + a] for i in which]
            sizes = [[b - a] for _ in which]
            offsets = [[hlen + a] for _ in which]
            if k == 0:  # the headers come with the first pieces
                ptrs = [[base + i * hlen, *p] for i, p in zip(which, ptrs, strict=True)]
                sizes = [[hlen, *z] for z in sizes]
                offsets = [[0, *o] for o in offsets]
            return link.start("batch_get_into_multi_buffer_ranges", ranges,
                              [names[i] for i in which], ptrs, sizes, offsets)

        pending = ask(0, live) if live else None
        for k, (a, b) in enumerate(bounds):
            if pending is None:
                break
            asked, answers = live, pending()
            expected = (b - a) + (hlen if k == 0 else 0)
            for i, code in zip(asked, answers, strict=True):
                if code != expected:
                    codes[i] = code if code < 0 else hlen + plen + 1
            live = _leading(asked, lambda i: codes[i] == 0)
            pending = ask(k + 1, live) if live and k + 1 < len(bounds) else None
            for i in live:  # hashed while the next pieces move
                hashers[i].update(fetched.objs[i].byte_view().numpy()[a:b].data)
        for i in live:
            codes[i] = hlen + plen
        fetched.checksums = [hashers[i].intdigest() if i in hashers else 0
                             for i in range(len(keys))]
        fetched.codes = codes
        return fetched
    except BaseException:
        fetched.release()
        raise
    finally:
        if opened:
            with contextlib.suppress(Exception):  # local: the lease ends it anyway
                link.call("batch_get_session_end", store.batch_get_session_end, list(names))


def _leading(indices: Sequence[int] | range, ok: Callable[[int], bool]) -> list[int]:
    """The leading run of ``indices`` that are ``ok`` (a get answers a prefix)."""
    run = []
    for i in indices:
        if not ok(i):
            break
        run.append(i)
    return run


def _sizes_told_apart(store: Any, call: Callable[..., Any], names: Sequence[str],
                      codes: list[int], frame_len: int) -> list[int]:
    """Mooncake 0.3.13 answers a frame smaller than the buffers with TRANSFER_FAIL,
    refused before any transfer starts, just as it answers a transfer that
    failed. Up to the first code that is not a frame, ask the entry's size: one
    that is not ``frame_len`` is a size mismatch (its size replaces the code);
    any other stays a failure."""
    for i, code in enumerate(codes):
        if code == frame_len:
            continue
        if code == TRANSFER_FAIL:
            size = call("get_size", store.get_size, names[i])
            if size > 0 and size != frame_len:
                codes[i] = size
        break
    return codes


def settle(fetched: Fetched, layout: Layout, out: list[MemoryObj]) -> tuple[int, str]:
    """Check each fetched frame (header bound to its key and of the guessed
    layout, payload checksum) and append the good leading ones to ``out``;
    returns how many and why it stopped (FOUND: all), or raises the fault of a
    failed transfer (``raise_for``). Releases (or quarantines, see
    ``Fetched.release``) the rest."""
    try:
        block = fetched.header_block
        if fetched.codes is None or block is None:  # nothing was asked
            return 0, OTHER_LAYOUT
        hlen, plen = layout.header_len, layout.payload_len
        headers = block.tensor.numpy()
        taken = 0
        for i, (key, code) in enumerate(zip(fetched.keys, fetched.codes, strict=True)):
            if code in NOT_THERE:
                return taken, ABSENT
            if code != hlen + plen:
                # (NOT_IN_PLACE only as a get session answers it: fetch_ranged's
                # windows are those with checksums)
                if code >= 0 or code == BUFFER_TOO_SMALL or (
                        code in NOT_IN_PLACE and fetched.checksums is not None):
                    return taken, OTHER_LAYOUT  # another size...: the staged way reads it
                # A failed transfer or call: the tier's fault (RPC-class codes open
                # the breaker), not retried staged; the buffers are quarantined.
                raise_for("batch_get_into_multi_buffers", code)
            obj = fetched.objs[i]
            try:
                header = read_header(headers[i * hlen:(i + 1) * hlen].data, key,
                                     frame_len=code)
                if Layout.of(header) != layout:
                    return taken, OTHER_LAYOUT
                if fetched.checksums is None:
                    verify_payload(header, obj.byte_view().numpy().data)
                elif fetched.checksums[i] != header.checksum:
                    raise CorruptFrameError("frame payload checksum mismatch")
            except CorruptFrameError:
                # Read under a guessed layout, a valid frame of another shape (a
                # longer header, the same total size) or a torn read fails here too:
                # the staged read checks the frame by its own length and drops it
                # only if it is corrupt there.
                return taken, OTHER_LAYOUT
            out.append(obj)
            taken += 1
            fetched.handed = taken
        return taken, FOUND
    finally:
        fetched.release()
