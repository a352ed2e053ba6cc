"""The storage manager: ordered tiers behind one put / lookup / prefetch API.

* Stores go to the first tier and are written through to the others
  asynchronously, each through a bounded queue (a full queue drops and counts
  the lower-tier write; the caller never waits on a slow tier).
* Lookups are strict prefixes across tiers: tier 1 serves chunks 0..k1,
  tier 2 serves k1..k2, and so on (``lmkv.storage.prefetch`` has the exact rules).
* Reads: a synchronous read (``get``, ``stream``) plans and fetches on the
  caller's thread; only an asynchronous lookup (``lookup_and_prefetch``) runs
  on the prefetch threads and holds its result in the prefetch table.
* Lower-tier hits are promoted into the first tier when it holds memory, once
  the read is over (``lmkv.storage.promotion``).
* Tiers are built memory first (``lmkv.storage.build``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from lmkv.base import affinity
from lmkv.base.futures import Finished
from lmkv.base.logutil import RateLimitedLog
from lmkv.config.model import LMKVConfig
from lmkv.contracts.tier import (
    ArenaPlacement,
    StorageBackend,
    done_future,
)
from lmkv.contracts.versions import parse_version
from lmkv.keys.aliases import Alias, alias_target, is_alias, make_alias
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj, nbytes_of, release
from lmkv.plugins.contract import declared_version
from lmkv.storage.admission import AdmissionGate
from lmkv.storage.build import (
    ReadAllocate,
    build_tiers,
    close_all,
    memory_tier,
    tensor_allocate,
)
from lmkv.storage.prefetch import EventManager, PrefetchTask, WeightedSemaphore
from lmkv.storage.promotion import Promotion
from lmkv.storage.writethrough import WriteThrough

logger = logging.getLogger(__name__)
_room_log = RateLimitedLog(logger)

GET_TIMEOUT_S = 30.0
#: The most chunks below the first tier a lookup starts on its caller's thread
#: (tiers that look up in memory: ``StorageBackend.lookups_in_memory``); a
#: longer one is handed to a prefetch thread, so no caller waits long on opens.
INLINE_LOOKUP_CHUNKS = 32
#: How many dropped keys a manager remembers, to keep reads in flight from
#: promoting them back (a read lasts at most GET_TIMEOUT_S).
DROPPED_REMEMBERED = 1024
_CONFIG = LMKVConfig.model_fields  # defaults are the config's, written once


@dataclass
class _Gets:
    """The gets of a lookup's plan, started (``StorageManager._start_gets``): one
    future per planned tier, and the prefetch semaphore's chunks they hold."""

    futures: list[Future]
    semaphore: WeightedSemaphore | None
    taken: int

    def settled(self, plans: list[tuple[StorageBackend, list[CacheKey]]]) -> bool:
        """Every get done, each with all its planned chunks and no alias among them
        (an alias is followed with a read): what is left of the lookup needs no
        I/O."""
        try:
            for (_, ks), future in zip(plans, self.futures, strict=True):
                if not future.done() or future.cancelled() or future.exception() is not None:
                    return False
                got = future.result()
                if len(got) != len(ks) or any(len(obj.shape) == 1 for obj in got):
                    return False
        except Exception:  # a tier's bug: the prefetch thread's last resort takes it
            return False
        return True


class StorageManager:
    def __init__(self, tiers: Sequence[StorageBackend], *,
                 write_queue_chunks: int = _CONFIG["write_through_queue_chunks"].default,
                 prefetch_threads: int = 4,
                 admit_after: Sequence[int] | None = None) -> None:
        """``admit_after[i]``: tier ``i`` stores a chunk from its N-th sighting only
        (``lmkv.storage.admission``; 1, the default, admits every chunk)."""
        if not tiers:
            raise ValueError("the storage manager needs at least one tier")
        self.tiers = list(tiers)
        self._memory = memory_tier(self.tiers)
        # Reads into memory make room as stores do (given back at close: the tiers
        # must not keep this manager alive).
        self._reads = [read for tier in self.tiers
                       if isinstance(read := tier.context.allocate, ReadAllocate)
                       and read.memory is self._memory]
        for read in self._reads:
            read.target = self.allocate
        # Every tier looks up in memory and starts its reads without waiting (a
        # first tier that holds memory is asked on the caller's thread anyway):
        # a lookup may start there.
        self._looks_up_here = all(looks_up_in_memory(t) for t in self.tiers[1:]) and (
            looks_up_in_memory(self.tiers[0]) or self.tiers[0].holds_memory_objs)
        self._handed: dict[object, tuple[Any, ...]] = {}  # lookups handed over, not run
        self._handed_lock = threading.Lock()
        # Only a first tier that holds memory takes promotions: else reads collect none.
        self._promotes = self.tiers[0].holds_memory_objs
        self._gates: list[AdmissionGate | None] = [
            AdmissionGate(n, t.capacity_bytes) if n > 1 else None
            for t, n in zip(self.tiers, admit_after or [1] * len(self.tiers), strict=True)]
        self._writers = [WriteThrough(t, write_queue_chunks) for t in self.tiers[1:]]
        self.events = EventManager()
        self._executor = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="lmkv-prefetch",
                                            initializer=affinity.apply)
        self._semaphore: WeightedSemaphore | None = None
        self._closed = False
        # Keys dropped as unusable (``drop``) lately: a read that collected one
        # before the drop must not promote it back.
        self._dropped: OrderedDict[CacheKey, None] = OrderedDict()
        self._dropped_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: LMKVConfig, *,
                    arena: ArenaPlacement = ArenaPlacement.PRIVATE,
                    dry_run: bool = False) -> StorageManager:
        """The config's tiers, built from its resolved plugins (``lmkv.storage.build``:
        the tier that holds memory first, the others handed its ``allocate``).
        ``arena`` is where the first tier that holds memory places its arena (the
        lmkv server asks for shared memory); the other tiers' arenas stay private.
        ``dry_run``: each tier is told it is built only to check it can be
        (``BackendContext.dry_run``, ``lmkv config check``): close the manager at
        once."""
        tiers = build_tiers(config, arena, dry_run)
        try:
            return cls(tiers, write_queue_chunks=config.write_through_queue_chunks,
                       admit_after=[t.admit_after for t in config.tiers])
        except BaseException:
            close_all(tiers)  # what the tiers hold goes back, whatever stopped the start
            raise

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """Size the prefetch semaphore: half the memory tier's capacity, in chunks."""
        memory = self._memory
        capacity = memory.capacity_bytes if memory is not None else None
        if capacity:
            self._semaphore = WeightedSemaphore(max(1, capacity // chunk_bytes // 2))

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A chunk buffer from the first tier that holds memory (evicting as needed);
        a plain tensor when no tier does (nothing then keeps it past the call).

        Chunks waiting in a write-through queue are held, so the tier cannot evict
        them: when it finds no room, chunks whose writes have not started are given
        up one at a time (``WriteThrough.give_up_one``: the oldest write first, its
        tail first, only a chunk nothing else holds), each then evictable, until the
        tier has room or no such chunk waits. A lower tier that cannot keep up
        loses its oldest writes, not the first tier its new chunks (without this, a
        slow disk under a small memory tier refused every new store until it caught
        up)."""
        memory = self._memory
        if memory is None:
            return tensor_allocate(shape, dtype)
        obj = memory.allocate(shape, dtype)
        if obj is None and self._writers:
            capacity = memory.capacity_bytes
            if capacity is None or nbytes_of(shape, dtype) <= capacity:
                given_up = 0
                try:
                    while obj is None and self._give_up_a_write():
                        given_up += 1
                        obj = memory.allocate(shape, dtype)
                except Exception:  # a bug here must not fail a read or a store
                    logger.exception("lmkv: making room in the %s tier failed", memory.name)
                if given_up:
                    _room_log.warning("behind", "lmkv: lower tiers fall behind; gave up the queued "
                                      "writes of %d chunk(s) to make room in the %s tier",
                                      given_up, memory.name)
        return obj

    def _give_up_a_write(self) -> bool:
        """Give up one chunk's writes that wait in the queues (the queue whose oldest
        write is oldest is asked first; the chunk's writes waiting in the other
        queues go too); False when none can be."""
        writers = self._writers
        holders = 1 + len(writers)  # the first tier and one queue per lower tier
        for _, i in sorted((order, i) for i, w in enumerate(writers)
                           if (order := w.oldest_queued) is not None):
            obj = writers[i].give_up_one(holders)
            if obj is not None:
                for other in writers:
                    if other is not writers[i]:
                        other.give_up(obj)
                return True
        return False

    # -- store ---------------------------------------------------------------
    def put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
            parents: Sequence[CacheKey | None] | None = None,
            aliases: Sequence[Alias] = ()) -> Future:
        """Store in the first tier and queue the write-through to the others.

        ``parents[i]`` is the key ``keys[i]`` extends (the chunk before it in its
        prompt, None for a first chunk; ``chain_parents`` builds them): tiers that
        evict keep each prompt's head while its tail is stored. Tiers and queues
        take their own references: the caller may release its own at once.
        Returns the first tier's future; failures are counted and logged, never
        raised.

        ``aliases`` (``lmkv.keys.aliases``) name the leading blocks of chunks stored
        here or before; they are stored after the chunks, each extending its
        target. The future's count is then the entries stored, aliases
        included, capped at ``len(keys)``.
        """
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        if self._dropped:  # stored again: a later read may promote it
            with self._dropped_lock:
                for key in keys:
                    self._dropped.pop(key, None)
        if aliases:
            return self._put_with_aliases(keys, objs, parents, aliases)
        first = self.tiers[0]
        try:
            admitted_keys, admitted_objs, admitted_parents = self._admitted(0, keys, objs, parents)
            future = guarded(first, "put", first.batched_submit_put(
                admitted_keys, admitted_objs, parents=admitted_parents), 0,
                "the writes are dropped")
        except Exception as exc:  # the last resort: a tier's bug never stops the engine
            first.faults.last_resort("put", exc, "the writes are dropped")
            future = done_future(0)
        for i, writer in enumerate(self._writers, 1):
            admitted = self._admitted(i, keys, objs, parents)
            if admitted[0]:
                writer.submit(*admitted)
        return future

    def _put_with_aliases(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                          parents: Sequence[CacheKey | None] | None,
                          aliases: Sequence[Alias]) -> Future:
        made: list[tuple[Alias, MemoryObj]] = []
        for alias in aliases:
            obj = make_alias(alias.target, self.allocate)
            if obj is None:
                break
            made.append((alias, obj))
        try:
            chunk_parents = list(parents) if parents is not None else [None] * len(keys)
            future = self.put([*keys, *(a.key for a, _ in made)],
                              [*objs, *(o for _, o in made)],
                              [*chunk_parents, *(a.target for a, _ in made)])
        finally:
            release([o for _, o in made])
        n = len(keys)
        out: Future = Future()
        future.add_done_callback(lambda f: out.set_result(min(n, f.result())))
        return out

    def _admitted(self, i: int, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                  parents: Sequence[CacheKey | None] | None
                  ) -> tuple[Sequence[CacheKey], Sequence[MemoryObj],
                             Sequence[CacheKey | None] | None]:
        """What tier ``i``'s admission gate lets through (all when it has none);
        the rejected chunks are counted in the tier's ``admission_rejects``."""
        gate = self._gates[i]
        if gate is None or not keys:
            return keys, objs, parents
        keys, objs, parents, rejected = gate.admit(keys, objs, parents, objs[0].nbytes)
        if rejected:
            self.tiers[i].counters.admission_rejects += rejected
        return keys, objs, parents

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the write-through queues to drain; False on timeout."""
        return all(w.flush(timeout) for w in self._writers)

    # -- lookup ----------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[CacheKey]) -> int:
        """How many leading keys the tiers hold, as a strict prefix across tiers."""
        hits = 0
        for tier in self.tiers:
            if hits == len(keys):
                break
            hits += self._contains(tier, "", keys[hits:], pin=False)
        return hits

    def pin_prefix(self, keys: Sequence[CacheKey]) -> list[tuple[StorageBackend, list[CacheKey]]]:
        """Pin the prefix of ``keys`` that the first tier holds; undo with ``unpin``.

        For stores: the chunks it returns need not be stored again, and the
        pins keep the store's own allocations from evicting them. Only the
        first tier is asked: a store never waits on a lower tier (a remote one
        may take its whole timeout to answer). Chunks only a lower tier holds
        are stored again in the first; their write-through finds them present.
        """
        first = self.tiers[0]
        hits = self._contains(first, "", keys, pin=True)
        return [(first, list(keys[:hits]))] if hits else []

    def unpin(self, plans: list[tuple[StorageBackend, list[CacheKey]]]) -> None:
        for tier, keys in plans:
            for key in keys:
                tier.unpin(key)

    def _contains(self, tier: StorageBackend, lookup_id: str, keys: Sequence[CacheKey],
                  pin: bool) -> int:
        try:
            return tier.batched_async_contains(lookup_id, keys, pin=pin)
        except Exception as exc:  # the last resort: a tier's bug is a (loud) miss
            tier.faults.last_resort("lookup", exc, "a miss")
            return 0

    def lookup_and_prefetch(self, lookup_id: str, keys: Sequence[CacheKey],
                            chunk_ends: Sequence[int], keys_per_chunk: int = 1,
                            partials: Partials | None = None, direct: bool = False) -> Future:
        """Start fetching the stored prefix of ``keys``; resolves to the hit tokens.

        ``chunk_ends[i]`` is the cumulative token count after chunk ``i``;
        ``keys_per_chunk`` is the number of layers in layerwise mode, else 1.
        ``partials`` (block-granular hits): the keys of each chunk's leading
        blocks; after the last whole chunk hit, the longest of the next chunk's
        that resolves is served too (its chunk then holds more tokens than the
        hit: the caller uses the leading ones). The chunks are then taken with
        ``take_prefetched`` or released with ``release_prefetched``. ``direct``: the
        caller reads chunks into its KV itself, so tiers below the first that can
        leave them in place do (``lmkv.contracts.direct_chunk.DirectChunk``; whole chunks only, not
        promoted).
        """
        if self._closed:
            return done_future(0)
        keys = list(keys)
        first = self.tiers[0]
        # A first tier that holds memory is asked here (no I/O), and a lookup it
        # holds whole is answered on the caller's thread (a hand-off to the
        # prefetch threads and back costs more than the whole lookup). Whole
        # chunks are read from it at once (the references taken keep them); what
        # it holds of a longer prompt is pinned for the plan, its reads kept as
        # that plan's first get.
        first_got: Future | None = None
        task: PrefetchTask | None = None
        pinned: int | None = None
        if first is self._memory and keys_per_chunk == 1:
            try:
                future = first.batched_get_non_blocking(lookup_id, keys)
            except Exception as exc:  # a failed get is a miss (``_start_get``)
                future = Future()
                future.set_exception(exc)
            if future.done():  # (answered at once, the memory tiers' way: read here)
                got = (future.result() if type(future) is Finished
                       else self._result(first, future))
                if len(got) >= len(keys):
                    return self._answer_whole(lookup_id, keys, chunk_ends, got, partials)
                task = self.events.start(lookup_id, keys)
                pinned = self._pin_got(first, lookup_id, keys, got)
                first_got = done_future(got[:pinned])
            else:  # a get that answers later is not waited for here: asked as before
                future.add_done_callback(_release_result)
        if task is None:
            task = self.events.start(lookup_id, keys)
            pinned = (self._contains(first, lookup_id, keys, pin=True)
                      if first.holds_memory_objs else None)
        args = (task, keys, list(chunk_ends), keys_per_chunk, partials,
                direct and keys_per_chunk == 1, pinned, None, None, first_got)
        if pinned == len(keys):
            self._prefetch(*args)
            return task.future
        if self._looks_up_here and self._look_up_here(*args[:7], first_got=first_got):
            return task.future
        try:
            self._executor.submit(self._prefetch, *args)
        except BaseException:
            for key in keys[:pinned or 0]:
                first.unpin(key)
            if first_got is not None:
                release(first_got.result())
            raise
        return task.future

    def _answer_whole(self, lookup_id: str, keys: list[CacheKey], chunk_ends: Sequence[int],
                      got: list[MemoryObj], partials: Partials | None) -> Future:
        """A lookup the first tier, holding memory, answered whole (a warm request's):
        its chunks, aliases followed, are the prefetch's, finished at once; nothing
        to promote. An alias that no longer resolves ends the answer there, with the
        longest leading part of that chunk found (``partials``), as ``_prefetch``."""
        try:
            if len(got) > len(keys):  # a tier may answer no more than it was asked
                release(got[len(keys):])
                got = got[:len(keys)]
            longer: list[int] = []
            objs = self._resolved(keys, got, longer)
            hit = chunk_ends[len(objs) - 1] if objs else 0
            held: Sequence[CacheKey] = keys
            if partials is not None and len(objs) < len(keys):
                tail = self.partial_hit(partials, len(objs), lookup_id)
                if tail is not None:
                    key, obj, tokens = tail
                    held = (*keys[:len(objs)], key)
                    longer.append(len(objs))
                    objs.append(obj)
                    hit += tokens
            return self.events.finished(lookup_id, held, objs, hit,
                                        min(longer, default=len(objs)))
        except Exception as exc:  # a bug, not a tier fault (tiers never raise)
            logger.exception("lmkv prefetch %s failed", lookup_id)
            task = self.events.start(lookup_id, keys)
            self.events.fail(task, exc)
            return task.future

    def _pin_got(self, tier: StorageBackend, lookup_id: str, keys: list[CacheKey],
                 got: list[MemoryObj]) -> int:
        """Pin the leading keys whose chunks ``got`` holds (a read of part of a
        lookup, kept as its plan's first get): how many were pinned; the
        references past them are given back."""
        pinned = self._contains(tier, lookup_id, keys[:len(got)], pin=True) if got else 0
        release(got[pinned:])
        return pinned

    def _look_up_here(self, task: PrefetchTask, keys: list[CacheKey], chunk_ends: list[int],
                      kpc: int, partials: Partials | None, direct: bool,
                      pinned: int | None, first_got: Future | None = None) -> bool:
        """A lookup over tiers that look up in memory, started on the caller's
        thread: the plan, and the reads (a tier that leaves chunks in place opens
        the entries whose pages are cached as it is asked). It ends here when
        every read is done, whole, with no alias to follow and nothing left to
        look for; otherwise a prefetch thread waits for the reads and ends it.
        False (nothing done): a lookup of more than ``INLINE_LOOKUP_CHUNKS``
        chunks past what the first tier pinned, or one the prefetch budget has
        no room for now, goes to a prefetch thread whole. A hand-off costs more
        than the whole lookup while the engine's own threads keep every CPU busy
        (vLLM's CPU build spins its OpenMP threads between forwards)."""
        chunks = len(keys) // kpc
        if chunks - (pinned or 0) // kpc > INLINE_LOOKUP_CHUNKS:
            return False
        semaphore = self._semaphore
        held = semaphore.acquire(chunks, timeout=0) if semaphore is not None and chunks else 0
        if semaphore is not None and chunks and not held:
            return False
        try:
            plans = self._plan(task.lookup_id, keys, kpc, pinned)
        except Exception as exc:  # a bug, not a tier fault (tiers never raise)
            if held:
                semaphore.release(held)  # type: ignore[union-attr]
            if first_got is not None:  # (the caller's pins of it as well)
                release(first_got.result())
                for key in keys[:pinned or 0]:
                    self.tiers[0].unpin(key)
            logger.exception("lmkv prefetch %s failed", task.lookup_id)
            self.events.fail(task, exc)
            return True
        gets = self._start_gets(task.lookup_id, plans, kpc, direct, held, first_got)
        args = (task, keys, chunk_ends, kpc, partials, direct, pinned, plans, gets)
        whole = sum(len(ks) for _, ks in plans) == len(keys)
        if gets.settled(plans) and (partials is None or whole):
            self._prefetch(*args)
        else:
            self._hand_over(args)
        return True

    def _hand_over(self, args: tuple[Any, ...]) -> None:
        """A lookup whose reads were started, ended on a prefetch thread; one the
        manager's close cancels before it runs gives back what it holds there."""
        token = object()
        with self._handed_lock:
            self._handed[token] = args
        try:
            self._executor.submit(self._end_handed, token)
        except RuntimeError:  # shut down meanwhile (or no thread to be had): a miss
            with self._handed_lock:
                mine = self._handed.pop(token, None)
            if mine is not None:
                self._abandon(mine)

    def _end_handed(self, token: object) -> None:
        with self._handed_lock:
            args = self._handed.pop(token, None)
        if args is not None:
            self._prefetch(*args)

    def _abandon_handed(self) -> None:
        """Give back what the lookups handed over and never run hold."""
        with self._handed_lock:
            left, self._handed = list(self._handed.values()), {}
        for args in left:
            self._abandon(args)

    def _abandon(self, args: tuple[Any, ...]) -> None:
        """A lookup handed over that will never run: its pins and its prefetch
        budget go back, what its reads return is released as it returns, and it
        answers a miss."""
        task, *_, plans, gets = args
        for (tier, ks), future in zip(plans, gets.futures, strict=True):
            future.add_done_callback(_release_result)
            for key in ks:
                tier.unpin(key)
        if gets.semaphore is not None and gets.taken:
            gets.semaphore.release(gets.taken)
        with contextlib.suppress(InvalidStateError):  # (answered meanwhile: closed)
            if not task.future.done():
                self.events.finish(task, [], 0)

    def take_prefetched(self, lookup_id: str, keys: Sequence[CacheKey] | None = None,
                        timeout: float | None = None, longer: bool = False
                        ) -> list[MemoryObj] | None:
        """The chunks a lookup prefetched (waits for it); the caller owns the references.

        With ``keys``, None unless the lookup was for a prefix of these keys.
        Without, the chunks end before the first that may hold more tokens than
        its key names (block-granular hits), unless ``longer``: the caller then
        cuts that chunk to the hit itself (``EventManager.take``).
        """
        future = self.events.future(lookup_id)
        if future is None:
            return None
        future.result(timeout)
        return self.events.take(lookup_id, keys, longer)

    def release_prefetched(self, lookup_id: str) -> None:
        """Release what a lookup prefetched (now, or as soon as it finishes)."""
        self.events.cleanup(lookup_id)

    def get(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        """The leading chunks found across the tiers; the caller owns the references.

        Read on the caller's thread (no prefetch is started or recorded); what
        lower tiers returned is promoted once the chunks are read."""
        if self._closed or not keys:
            return []
        promotion = Promotion()
        try:
            plans = self._plan("", list(keys), 1)
            return self._fetch("", plans, 1, promotion) if plans else []
        except Exception:  # a bug, not a tier fault (tiers never raise): a miss
            logger.exception("lmkv get of %d chunks failed", len(keys))
            return []
        finally:
            self._promote(promotion)

    def _prefetch(self, task: PrefetchTask, keys: list[CacheKey], chunk_ends: list[int],
                  keys_per_chunk: int, partials: Partials | None, direct: bool = False,
                  pinned: int | None = None,
                  plans: list[tuple[StorageBackend, list[CacheKey]]] | None = None,
                  gets: _Gets | None = None, first_got: Future | None = None) -> None:
        """``pinned``: the leading keys the first tier holds, pinned by the caller
        (None: not asked yet). ``plans`` and ``gets``: the plan made and the reads
        started already, on the caller's thread (``_look_up_here``). ``first_got``:
        the first tier's read of its ``pinned`` keys, made already (``_start_gets``)."""
        promotion = Promotion()
        try:
            if plans is None:
                plans = self._plan(task.lookup_id, keys, keys_per_chunk, pinned)
            longer: list[int] = []
            objs = (self._fetch(task.lookup_id, plans, keys_per_chunk, promotion, longer,
                                direct, gets, first_got) if plans else [])
            chunks = len(objs) // keys_per_chunk
            hit = chunk_ends[chunks - 1] if chunks else 0
            if partials is not None and keys_per_chunk == 1 and chunks < len(keys):
                tail = self.partial_hit(partials, chunks, task.lookup_id)
                if tail is not None:
                    key, obj, tokens = tail
                    longer.append(len(objs))
                    objs.append(obj)
                    task.keys = (*task.keys[:chunks], key)
                    hit += tokens
            # A take without keys cannot cut these to their tokens: it stops before.
            task.whole = min(longer, default=len(objs))
            # Promoted before the answer, not after: once a lookup has answered, its
            # lower-tier hits are memory hits for the next one.
            self._promote(promotion)
            self.events.finish(task, objs, hit)
        except Exception as exc:  # a bug, not a tier fault (tiers never raise)
            logger.exception("lmkv prefetch %s failed", task.lookup_id)
            self._promote(promotion)  # what it read is sound, and its references go back
            self.events.fail(task, exc)

    # -- block-granular hits (lmkv.keys.aliases) ------------------------------------
    def partial_hit(self, partials: Partials, index: int, lookup_id: str = ""
                    ) -> tuple[CacheKey, MemoryObj, int] | None:
        """The longest leading part of chunk ``index`` that some tier serves:
        ``(its key, the chunk that holds it, its tokens)``; the caller owns the
        reference. The chunk may hold more tokens than the part (an alias's
        target); the first ``tokens`` of it are the part's."""
        if index >= len(partials.keys) or not partials.keys[index]:
            return None
        candidates = partials.keys[index]
        counted: list[tuple[int, int, StorageBackend]] = []
        for i, tier in enumerate(self.tiers):  # a tier that has them all ends the asking
            blocks = self._contains(tier, lookup_id, candidates, pin=False)
            counted.append((blocks, -i, tier))
            if blocks == len(candidates):
                break
        for blocks, _, tier in sorted(counted, key=lambda t: t[:2], reverse=True):
            if not blocks:
                break
            key = candidates[blocks - 1]
            obj = self.resolve(tier, key)
            if obj is not None:
                return key, obj, blocks * partials.block_tokens
        return None

    def read(self, key: CacheKey) -> MemoryObj | None:
        """The chunk under ``key`` in the first tier that serves it (an alias followed
        to its target); the caller owns it."""
        for tier in self.tiers:
            obj = self.resolve(tier, key)
            if obj is not None:
                return obj
        return None

    def resolve(self, tier: StorageBackend, key: CacheKey) -> MemoryObj | None:
        """The chunk stored under ``key`` in ``tier``, an alias followed to its target
        (looked for in ``tier`` first, then in the others); the caller owns it."""
        obj = self._get_one(tier, key)
        if obj is None or not is_alias(obj):
            return obj
        target = alias_target(key, obj)
        release([obj])
        return None if target is None else self.resolve_target(target, first=tier)

    def _get_one(self, tier: StorageBackend, key: CacheKey) -> MemoryObj | None:
        try:
            return tier.get_blocking(key)
        except Exception as exc:  # the last resort, as for gets
            tier.faults.last_resort("get", exc, "a miss")
            return None

    def _resolved(self, keys: Sequence[CacheKey], objs: list[MemoryObj],
                  longer: list[int] | None = None) -> list[MemoryObj]:
        """``objs`` (chunks of ``keys``) with each alias replaced by its target; the
        answer ends before an alias that no longer resolves. The positions of
        targets (chunks that may hold more tokens than their key names) are
        appended to ``longer``."""
        out: list[MemoryObj] = []
        for i, (key, obj) in enumerate(zip(keys, objs, strict=False)):
            target = alias_target(key, obj) if len(obj.shape) == 1 else None
            if target is None:
                out.append(obj)
                continue
            release([obj])
            resolved = self.resolve_target(target)
            if resolved is None:
                release(objs[i + 1:])
                return out
            if longer is not None:
                longer.append(i)
            out.append(resolved)
        return out

    def resolve_target(self, target: CacheKey, first: StorageBackend | None = None
                       ) -> MemoryObj | None:
        """The chunk an alias names, from ``first`` or else any tier; an alias of an
        alias is never followed."""
        for tier in sorted(self.tiers, key=lambda t: t is not first):
            found = self._get_one(tier, target)
            if found is not None:
                if is_alias(found):
                    release([found])
                    return None
                return found
        return None

    def _plan(self, lookup_id: str, keys: list[CacheKey], kpc: int,
              first_pinned: int | None = None) -> list[tuple[StorageBackend, list[CacheKey]]]:
        """Which tier serves which keys; the planned keys are pinned.
        ``first_pinned``: the first tier was asked (and pinned) already."""
        plans = []
        done = 0
        for i, tier in enumerate(self.tiers):
            if done == len(keys):
                break
            remaining = keys[done:]
            raw = (first_pinned if i == 0 and first_pinned is not None
                   else self._contains(tier, lookup_id, remaining, pin=True))
            hit = raw // kpc * kpc
            for key in remaining[hit:raw]:
                tier.unpin(key)
            if hit:
                plans.append((tier, remaining[:hit]))
                done += hit
        return plans

    def _fetch(self, lookup_id: str, plans: list[tuple[StorageBackend, list[CacheKey]]],
               kpc: int, promotion: Promotion, longer: list[int] | None = None,
               direct: bool = False, gets: _Gets | None = None,
               first_got: Future | None = None) -> list[MemoryObj]:
        if gets is None and kpc == 1 and len(plans) == 1 \
                and plans[0][0] is self._memory is self.tiers[0]:
            return self._fetch_memory(lookup_id, plans[0][1], longer, first_got)
        objs: list[MemoryObj] = []
        with closing(self._iter_fetch(lookup_id, plans, kpc, promotion, direct,
                                      gets, first_got)) as reads:
            for _, ks, got in reads:
                found: list[int] = []
                resolved = self._resolved(ks, got, found) if kpc == 1 else got
                if longer is not None:
                    longer.extend(len(objs) + i for i in found)
                objs.extend(resolved)
                if len(resolved) < len(got):
                    break
        whole = len(objs) // kpc * kpc
        release(objs[whole:])
        return objs[:whole]

    def _fetch_memory(self, lookup_id: str, keys: list[CacheKey],
                      longer: list[int] | None, first_got: Future | None = None
                      ) -> list[MemoryObj]:
        """``_fetch`` of a plan the first tier, holding memory, serves whole: the
        same get (``first_got`` where made already), pins and aliases, with
        nothing to promote and no prefetch budget to take (its gets allocate
        nothing)."""
        tier = self._memory
        assert tier is not None
        try:
            got = self._result(tier, first_got if first_got is not None
                               else self._start_get(tier, lookup_id, keys))
        finally:
            for key in keys:
                tier.unpin(key)
        if len(got) > len(keys):  # a tier may answer no more than it was asked
            release(got[len(keys):])
            got = got[:len(keys)]
        found: list[int] = []
        objs = self._resolved(keys, got, found)
        if longer is not None:
            longer.extend(found)
        return objs

    def stream(self, keys: Sequence[CacheKey]) -> Iterator[tuple[int, list[MemoryObj]]]:
        """The leading chunks across the tiers, yielded tier by tier as each tier's
        get completes: ``(index of the first chunk, chunks)``. The caller owns the
        references. All gets start at once, so the caller can copy out what an
        upper tier returned while lower tiers are still reading. Read on the
        caller's thread; what lower tiers returned is promoted when the stream
        ends (its last chunks taken, or closed)."""
        if self._closed or not keys:
            return
        promotion = Promotion()
        try:
            plans = self._plan("", list(keys), 1)
            index = 0
            with closing(self._iter_fetch("", plans, 1, promotion)) as reads:
                for _, ks, got in reads:
                    resolved = self._resolved(ks, got)
                    yield index, resolved
                    index += len(resolved)
                    if len(resolved) < len(got):
                        return
        finally:
            self._promote(promotion)

    def _start_gets(self, lookup_id: str, plans: list[tuple[StorageBackend, list[CacheKey]]],
                    kpc: int, direct: bool, held: int | None = None,
                    first_got: Future | None = None) -> _Gets:
        """Start every planned get, once the prefetch semaphore has room for their
        chunks. ``held``: chunks of the semaphore taken already, for at least as
        many as planned (what the plan does not need goes back). ``first_got``:
        the first tier's get, made already (its keys pinned: the plan's first)."""
        chunks = sum(len(ks) for _, ks in plans) // kpc
        # (gets from the tier that holds memory allocate nothing: not counted)
        semaphore = (self._semaphore if chunks and any(t is not self._memory for t, _ in plans)
                     else None)
        if held is None:
            taken = semaphore.acquire(chunks) if semaphore else 0
        else:
            taken = min(held, chunks) if semaphore else 0
            if held > taken:
                self._semaphore.release(held - taken)  # type: ignore[union-attr]
        first = self.tiers[0]
        futures = [first_got if first_got is not None and tier is first
                   else self._start_get(tier, lookup_id, ks, direct and tier is not first)
                   for tier, ks in plans]
        return _Gets(futures, semaphore, taken)

    def _iter_fetch(self, lookup_id: str, plans: list[tuple[StorageBackend, list[CacheKey]]],
                    kpc: int, promotion: Promotion, direct: bool = False,
                    gets: _Gets | None = None, first_got: Future | None = None
                    ) -> Generator[tuple[StorageBackend, list[CacheKey], list[MemoryObj]],
                                   None, None]:
        """Start every planned get (unless ``gets`` did already), then yield each
        tier's chunks in order.

        A tier that returns fewer chunks than planned ends the answer there:
        everything after it is released. Pins are dropped as each tier
        completes. What lower tiers returned (up to a chunk left in place) is
        collected in ``promotion``, each with the parent it has in the prompt,
        for the caller to promote once the read is over.
        """
        if gets is None:
            gets = self._start_gets(lookup_id, plans, kpc, direct, first_got=first_got)
        futures, semaphore, taken = gets.futures, gets.semaphore, gets.taken
        done = 0
        short = False
        before: CacheKey | None = None  # the key before this plan's first
        try:
            for (tier, ks), future in zip(plans, futures, strict=True):
                got = self._result(tier, future)
                if len(got) > len(ks):  # a tier may answer no more than it was asked
                    release(got[len(ks):])
                    got = got[:len(ks)]
                done += 1
                for key in ks:
                    tier.unpin(key)
                if short:
                    release(got)
                    continue
                short = len(got) < len(ks)  # evicted between contains and get
                if self._promotes and tier is not self.tiers[0] and got:
                    promotion.add(ks, got, chain_parents(ks[:len(got)], before, kpc))
                before = ks[len(ks) - kpc] if len(ks) >= kpc else before
                yield tier, ks, got
        finally:  # also when the consumer stops early: release what it did not take
            for (tier, ks), future in zip(plans[done:], futures[done:], strict=True):
                release(self._result(tier, future))
                for key in ks:
                    tier.unpin(key)
            if semaphore and taken:
                semaphore.release(taken)

    def _start_get(self, tier: StorageBackend, lookup_id: str, keys: list[CacheKey],
                   direct: bool = False) -> Future:
        try:
            direct_get = tier.batched_get_direct(lookup_id, keys) if direct else None
            return direct_get or tier.batched_get_non_blocking(lookup_id, keys)
        except Exception as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def _result(self, tier: StorageBackend, future: Future) -> list[MemoryObj]:
        try:
            return future.result(timeout=GET_TIMEOUT_S)
        except (Exception, CancelledError) as exc:  # the last resort, as for lookups
            if not future.done():  # timed out: what it gets later is nobody's
                future.add_done_callback(_release_result)
            tier.faults.last_resort("get", exc, "a miss")
            return []

    def _promote(self, promotion: Promotion) -> None:
        """Store what a read collected from lower tiers in the first tier: one put,
        not waited for (the tier takes its own references); the collected
        references are given back. Each chunk is a sighting for the first tier's
        admission gate."""
        if not promotion.keys:
            return
        keys, objs, parents = promotion.take()
        if self._dropped:  # a chunk dropped since it was read, and its tail, stay out
            with self._dropped_lock:
                cut = next((i for i, k in enumerate(keys) if k in self._dropped), len(keys))
            keys, parents = keys[:cut], parents[:cut]
        first = self.tiers[0]
        try:
            admitted = self._admitted(0, keys, objs[:len(keys)], parents)
            if admitted[0]:
                guarded(first, "promote", first.batched_submit_put(
                    admitted[0], admitted[1], parents=admitted[2]), 0, "not promoted")
        except Exception as exc:  # the last resort, as for puts
            first.faults.last_resort("promote", exc, "not promoted")
        finally:
            release(objs)

    def drop(self, key: CacheKey, problem: str) -> None:
        """Remove the entry under ``key``, which a reader found unusable (it does not
        fit the engine's KV), from every tier that holds it. It is counted as a
        corrupt entry once, in the lowest tier that holds it (a copy above it was
        promoted or written through from there), and removed from the others; a
        read that collected it before is kept from promoting it back. The next
        lookup misses there."""
        with self._dropped_lock:
            self._dropped[key] = None
            while len(self._dropped) > DROPPED_REMEMBERED:
                self._dropped.popitem(last=False)
        holders = []
        for tier in self.tiers:
            try:
                if tier.contains(key):
                    holders.append(tier)
            except Exception as exc:  # the last resort, as for lookups
                tier.faults.last_resort("lookup", exc, "not removed")
        for tier in holders:
            try:
                if tier is holders[-1]:
                    tier.drop_corrupt(key, problem)
                else:
                    tier.remove(key)
            except Exception as exc:  # one tier's bug leaves the others' removals be
                tier.faults.last_resort("remove", exc, "not removed")

    # -- the rest --------------------------------------------------------------
    def watch(self, listener: Callable[[int, CacheKey, bool], None] | None) -> list[int]:
        """Tell ``listener`` ``(tier index, key, stored)`` for every chunk a tier stores
        (True) or drops, evicted or removed (False); None stops it. Tiers are heard
        through their eviction policy: those that store through it (cpu, fs) are
        heard exactly, one that ignores its policy (a remote store that evicts by
        itself) is silent. Returns the indexes of the tiers with a policy. The
        listener runs under the tier's lock on the thread that changed the tier
        (a store, a write-through, a promotion): it must queue and return
        (``EvictionPolicy.watch``). Nothing is called, and nothing costs more than
        a test, while nobody watches."""
        watched = []
        for i, tier in enumerate(self.tiers):
            policy = tier.context.eviction_policy
            if policy is not None:
                policy.watch(None if listener is None else functools.partial(listener, i))
                watched.append(i)
        return watched

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for i, tier in enumerate(self.tiers):
            row = {"tier": i, "type": tier.name, **tier.stats()}
            if i:
                row["write_queue_chunks"] = self._writers[i - 1].pending_chunks
            out.append(row)
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Drain write-through queues (up to ``timeout``), release prefetches, close
        tiers (the tier that holds memory last)."""
        self._closed = True
        for writer in self._writers:
            writer.close(timeout)
        for read in self._reads:  # the tiers' reads no longer lead here
            read.target = read.memory.allocate
        self.events.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._abandon_handed()
        # The tier that holds memory last: the others may still hold its buffers
        # (reads, writes in flight) or serve it (the peer tier's endpoint).
        memory = self._memory
        last = [memory] if memory is not None else []
        for tier in [t for t in reversed(self.tiers) if t is not memory] + last:
            try:
                tier.close()
            except Exception:
                logger.exception("closing tier %s failed", tier.name)


@dataclass(frozen=True)
class Partials:
    """The keys of each chunk's leading whole blocks (``keys[i][j - 1]``: chunk
    ``i``'s first ``j`` blocks, ``lmkv.keys.chunking.block_prefix_hashes``) and the
    tokens in a block."""

    keys: Sequence[Sequence[CacheKey]]
    block_tokens: int


def chain_parents(keys: Sequence[CacheKey], before: CacheKey | None = None,
                  keys_per_chunk: int = 1) -> list[CacheKey | None]:
    """The parents of a run of consecutive chunks' keys: each key extends the key
    ``keys_per_chunk`` before it (the same layer of the previous chunk, in
    layerwise mode); the first chunk's keys extend ``before`` (the same layer of
    the chunk before the run) or nothing."""
    kpc = keys_per_chunk
    if kpc == 1:
        return [before, *keys[:-1]] if keys else []
    head: list[CacheKey | None] = (
        [before.with_layer(i) if before.layer >= 0 else before for i in range(kpc)]
        if before is not None else [None] * kpc)
    return [head[i] if i < kpc else keys[i - kpc] for i in range(len(keys))]


def looks_up_in_memory(tier: StorageBackend) -> bool:
    """``tier.lookups_in_memory``, taken from a class written for storage backend
    API 2.2 or later only: one written for an earlier API may inherit True from
    lmkv's cpu or fs tier without meaning it."""
    if not tier.lookups_in_memory:
        return False
    declared = parse_version(declared_version(type(tier), StorageBackend))
    return declared is not None and declared >= (2, 2)


def _release_result(future: Future) -> None:
    """Give back the buffers of a get whose caller stopped waiting."""
    if not future.cancelled() and future.exception() is None:
        release(future.result())


def guarded(tier: StorageBackend, op: str, future: Future, default: object,
            consequence: str) -> Future:
    """``future``, with what it raises (a bug in the tier: its faults are absorbed
    before) logged by the tier's last resort and answered with ``default``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(f.result())
        except (Exception, CancelledError) as exc:
            tier.faults.last_resort(op, exc, consequence)
            out.set_result(default)

    future.add_done_callback(done)
    return out

