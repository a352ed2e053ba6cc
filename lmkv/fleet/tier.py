"""The ``peer`` tier: the memory tiers of the other instances of a fleet.

Goes between the memory tier and remote stores. Each chunk key has an owner
among the fleet's instances (``lmkv.fleet.rendezvous``, over ``peers``, the
same list everywhere): a chunk this instance stores is pushed to its owner
(``push_to_owner``), and a lookup that missed locally asks each chunk's
owner, a run of chunks of one owner in one request. A chunk this instance
owns is its own memory tier's business: asked there (it may hold it because
another instance pushed it here).

What a peer answers is checked as any tier's frames are: decoded under the
key asked for, its checksum verified (``StorageBackend.decode``); a frame of
another key or a damaged one is a miss, never wrong KV. A peer that is down,
stalls or evicted the chunk since is a miss or a shorter hit, bounded by
``timeout_ms``; after a timeout that peer is skipped for ``retry_after_s``.
A frame that fails to verify is counted (``corrupt_frames``) and read as a
miss; the owner keeps its entry (its frames are made fresh from memory: a
failure says the two sides differ, not that the entry is bad). ``remove``
asks the owner to drop a key.

With ``listen``, the tier also starts this instance's endpoint
(``lmkv.fleet.endpoint``), which serves its memory tier (the storage
manager's, ``BackendContext.memory``) to the peers and takes their pushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from lmkv.base.errors import ConfigError
from lmkv.base.redact import secrets_in
from lmkv.contracts.faults import TierFaults
from lmkv.contracts.pins import PinTable
from lmkv.contracts.prefix_gets import PrefixGets
from lmkv.contracts.put_queue import PutQueue
from lmkv.contracts.remote import RemoteTierOptions, remote_faults
from lmkv.contracts.tier import BackendContext, StorageBackend, done_future
from lmkv.fleet import wire
from lmkv.fleet.directory import RedisDirectory
from lmkv.fleet.endpoint import PeerEndpoint
from lmkv.fleet.links import PeerLinks
from lmkv.fleet.options import PeerOptions
from lmkv.fleet.rendezvous import Rendezvous
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj
from lmkv.rpc import protocol as p
from lmkv.rpc.auth import peer_keys

logger = logging.getLogger(__name__)

GET_THREADS = 4
#: Registration batches that may wait for the directory; past it they are dropped.
MAX_REGISTRATIONS = 64


class PeerBackend(StorageBackend):
    name = "peer"
    api_version = "2.3"
    Options = PeerOptions

    options: PeerOptions

    def __init__(self, options: PeerOptions | dict | None = None,
                 context: BackendContext | None = None) -> None:
        super().__init__(options, context)
        options, context = self.options, self.context
        if context.serializer is None:
            raise ValueError("the peer tier needs a serializer")
        self.me = options.listen
        self.fleet = Rendezvous(options.members())
        memory = context.memory
        if memory is None and options.listen is not None:
            raise ConfigError(f"tiers.{context.tier_index}.options.listen: serving peers needs "
                              "a tier that holds memory (the cpu tier) in the same list")
        # (without listen no key is this instance's: the memory tier is never asked)
        self.memory: StorageBackend = memory if memory is not None \
            else _NoMemory()  # type: ignore[assignment]
        self.faults: TierFaults = remote_faults(
            self.counters, "peer tier", RemoteTierOptions(retry_after_s=options.retry_after_s),
            absorbed=(), unreachable=(), log=logger,
            secrets=secrets_in(options.directory) if options.directory else ())
        curve = peer_keys(options.curve) if options.curve is not None else None
        self.links = PeerLinks(self.faults, curve, options.timeout_ms, options.retry_after_s,
                               max_reply_bytes=int(options.max_reply_bytes))
        self._pins: PinTable[int] = PinTable()
        self._gets = PrefixGets(self.faults, GET_THREADS, "lmkv-peer-get")
        self._writer = _Pusher(self, options)
        self.directory: RedisDirectory | None = None
        self._directory_retry_at = 0.0
        self._registrations = 0  # batches waiting to be registered
        self._registrations_lock = threading.Lock()
        if options.directory is not None and not context.dry_run:
            self.directory = RedisDirectory(options.directory, self.fleet.members,
                                            ttl_s=options.directory_ttl_s,
                                            timeout_s=options.timeout_ms / 1000)
        self._close_lock = threading.Lock()
        self._closed = False
        self.endpoint: PeerEndpoint | None = None
        if options.insecure and any(m.startswith("tcp://") for m in self.fleet.members):
            logger.warning("lmkv peer tier: tcp:// without CURVE (insecure: true): whoever "
                           "reaches these ports can read this fleet's KV and send it KV")
        if memory is not None and options.listen is not None and not context.dry_run:
            try:
                self.endpoint = PeerEndpoint(
                    memory, context.serializer, options.listen, curve=curve,
                    max_reply_bytes=int(options.max_reply_bytes),
                    max_request_bytes=int(options.max_request_bytes),
                    accept_puts=options.accept_puts,
                    owns=self._owns).start()
            except BaseException:
                self.close()
                raise

    def __repr__(self) -> str:
        return f"PeerBackend(listen={self.me!r}, fleet={list(self.fleet.members)!r})"

    def _mine(self, owner: str | None) -> bool:
        return owner == self.me

    def _owns(self, key: CacheKey) -> bool:
        """Whether this instance takes pushes and removes of ``key``: its owner's,
        with a directory any it may hold."""
        return self.directory is not None or self.fleet.owner(key) == self.me

    def _runs(self, keys: Sequence[CacheKey]) -> list[tuple[str, int, int]]:
        """``keys`` cut into runs of one source: the owner (rendezvous), or with a
        directory a holder other than this instance, up to the first key that has
        none (the directory down: none)."""
        if self.options.directory is None:
            return self.fleet.runs(keys)
        directory = self.directory
        if directory is None or not keys or self._directory_down():
            return []
        try:
            holders = directory.holders(keys)
        except directory.errors as exc:
            self._directory_failed(exc, "misses")
            return []
        out: list[tuple[str, int, int]] = []
        for i, (key, found) in enumerate(zip(keys, holders, strict=True)):
            others = [h for h in found if h != self.me]
            if not others:
                break
            source = self.fleet.pick(others, key)
            if out and out[-1][0] == source:
                out[-1] = (source, out[-1][1], i + 1)
            else:
                out.append((source, i, i + 1))
        return out

    # -- lookups ------------------------------------------------------------------
    def contains(self, key: CacheKey, pin: bool = False) -> bool:
        return self.batched_async_contains("", [key], pin=pin) == 1

    def batched_async_contains(self, lookup_id: str, keys: Sequence[CacheKey],
                               pin: bool = False) -> int:
        hits = 0
        for owner, start, stop in self._runs(keys):
            run = keys[start:stop]
            if self._mine(owner):
                found = self.memory.batched_async_contains(lookup_id, run, pin=pin)
            else:
                found = self._probe(owner, run)
                if pin and found:
                    self._pins.pin([k.to_string() for k in run[:found]])
            hits += found
            if found < len(run):
                break
        return hits

    def _probe(self, owner: str, keys: Sequence[CacheKey]) -> int:
        found = 0
        for i in range(0, len(keys), wire.MAX_PEER_KEYS):
            part = list(keys[i:i + wire.MAX_PEER_KEYS])
            got = self.links.request(owner, wire.PeerFetch(probe=True, **p.key_fields(part)))
            count = got[0].frames if got is not None and isinstance(
                got[0], wire.PeerFetchReply) else 0
            found += min(count, len(part))
            if count < len(part):
                break
        return found

    def pin(self, key: CacheKey) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: CacheKey) -> bool:
        if self.options.directory is None and self._mine(self.fleet.owner(key)):
            return self.memory.unpin(key)
        return self._pins.unpin(key.to_string())

    # -- gets ---------------------------------------------------------------------
    def get_blocking(self, key: CacheKey) -> MemoryObj | None:
        objs = self._gets.read_prefix([key], self._read)
        return objs[0] if objs else None

    def batched_get_non_blocking(self, lookup_id: str, keys: Sequence[CacheKey]) -> Future:
        return self._gets.submit(keys, self._read)

    def _read(self, keys: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        """The leading chunks found, into ``out``: each run of one source from it."""
        for owner, start, stop in self._runs(keys):
            run = keys[start:stop]
            before = len(out)
            if self._mine(owner):
                for key in run:
                    obj = self.memory.get_blocking(key)
                    if obj is None:
                        break
                    out.append(obj)
            else:
                self._fetch(owner, run, out)
            if len(out) - before < len(run):
                return

    def _fetch(self, owner: str, keys: Sequence[CacheKey], out: list[MemoryObj]) -> None:
        i = 0
        while i < len(keys):
            part = list(keys[i:i + wire.MAX_PEER_KEYS])
            got = self.links.request(owner, wire.PeerFetch(**p.key_fields(part)))
            if got is None or not isinstance(got[0], wire.PeerFetchReply):
                return
            reply, frames = got
            if reply.frames != len(frames) or len(frames) > len(part):
                self.faults.note("bad-reply", "peer %s answered %d frames for %d keys (says "
                                 "%d): a miss", owner, len(frames), len(part), reply.frames)
                return
            if not frames:  # the owner holds no more of them
                return
            for key, frame in zip(part, frames, strict=False):
                obj = self._decode(owner, key, frame.buffer)
                if obj is None:
                    return
                self.counters.bytes_out += len(frame.buffer)
                out.append(obj)
            if len(frames) < len(part):
                i += len(frames)
                continue  # the answer stopped at max_reply_bytes, or the peer's hits
            i += len(part)

    def _decode(self, owner: str, key: CacheKey, frame: memoryview) -> MemoryObj | None:
        """``frame`` as ``key``'s chunk; None (counted, rate-logged) when it is not."""
        try:
            return self.decode(key, frame)
        except Exception as exc:  # CorruptFrameError, or what a crafted frame provokes
            # Counted, not removed at the owner: a frame made fresh from its memory
            # that fails here says the two sides differ (a serializer or frame
            # format of another version), not that its entry is bad.
            self.faults.corrupt(key.to_string(), f"from peer {owner}: {exc}")
            return None

    # -- puts ---------------------------------------------------------------------
    def batched_submit_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj],
                           parents: Sequence[CacheKey | None] | None = None) -> Future:
        if self.options.directory is not None:  # the chunks stay here, said held
            if self.me is not None and keys:
                self._queue_registration(list(keys))
            return done_future(0)
        if not self.options.push_to_owner:
            return done_future(0)
        picked = [(k, o) for k, o in zip(keys, objs, strict=True)
                  if not self._mine(self.fleet.owner(k))]
        if not picked:
            return done_future(0)
        return self._writer.submit([k for k, _ in picked], [o for _, o in picked])

    def _directory_down(self) -> bool:
        """Whether the directory failed less than ``retry_after_s`` ago (a hung Redis
        must not cost every lookup and store a timeout)."""
        return time.monotonic() < self._directory_retry_at

    def _directory_failed(self, exc: BaseException, what: str) -> None:
        self._directory_retry_at = time.monotonic() + self.options.retry_after_s
        self.counters.errors += 1
        directory = self.directory
        self.faults.note("directory", "directory %s: %s; %s, and it is not asked for %g s",
                         directory.where if directory else "?", exc, what,
                         self.options.retry_after_s)

    def _queue_registration(self, keys: list[CacheKey]) -> None:
        """Register ``keys`` in the background: at most ``MAX_REGISTRATIONS`` batches
        wait (past it, and while the directory is down, they are dropped, counted)."""
        with self._registrations_lock:
            full = self._registrations >= MAX_REGISTRATIONS or self._directory_down()
            if not full:
                self._registrations += 1
        if full or self._gets.run(self._register, keys) is None:
            if not full:
                with self._registrations_lock:
                    self._registrations -= 1
            self.counters.dropped_writes += len(keys)

    def _register(self, keys: list[CacheKey]) -> None:
        directory = self.directory
        try:
            if directory is None or self.me is None or self._directory_down():
                self.counters.dropped_writes += len(keys)
                return
            directory.register(self.me, keys)
        except directory.errors as exc:  # type: ignore[union-attr]
            self.counters.dropped_writes += len(keys)
            self._directory_failed(exc, f"{len(keys)} keys not registered")
        except Exception:  # a bug, on a background thread: say so
            logger.exception("lmkv peer tier: registering %d keys failed", len(keys))
        finally:
            with self._registrations_lock:
                self._registrations -= 1

    # -- the rest -----------------------------------------------------------------
    def remove(self, key: CacheKey) -> bool:
        """Drop ``key`` where its owner holds it (a frame found corrupt, a drop);
        with a directory, where this instance holds it."""
        if self.options.directory is not None:
            removed = self.me is not None and self.memory.remove(key)
            directory = self.directory
            if directory is None or self._directory_down():
                return bool(removed)
            try:
                holders = directory.holders([key])[0]
                if self.me is not None:
                    directory.unregister(self.me, [key])
            except directory.errors as exc:
                self._directory_failed(exc, "a remove reached this instance only")
                return bool(removed)
            for holder in holders:  # (the copy that was bad is one of theirs)
                if holder != self.me:
                    got = self.links.request(holder, wire.PeerRemove(**p.key_fields([key])))
                    removed = removed or (got is not None and isinstance(
                        got[0], wire.PeerRemoveReply) and got[0].removed > 0)
            return bool(removed)
        owner = self.fleet.owner(key)
        if self._mine(owner):
            return self.memory.remove(key)
        got = self.links.request(owner, wire.PeerRemove(**p.key_fields([key])))
        return got is not None and isinstance(got[0], wire.PeerRemoveReply) \
            and got[0].removed > 0

    @property
    def usage_bytes(self) -> int:
        return 0

    def stats(self) -> dict[str, int | None]:
        endpoint = self.endpoint
        return {**super().stats(), "peers": len(self.fleet.members),
                "peer_failures": self.links.failures,
                "pending_push_bytes": self._writer.pending_bytes,
                "served_frames": endpoint.served if endpoint else 0,
                "stored_frames": endpoint.stored if endpoint else 0,
                "rejected_frames": endpoint.rejected_frames if endpoint else 0}

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.endpoint is not None:
            self.endpoint.close()
        self._writer.close(self.options.close_timeout_s)
        self.faults.close()
        self._gets.close()
        self.links.close()
        if self.directory is not None:
            self.directory.close()
        self._pins.clear()
        super().close()


class _NoMemory:
    """The memory tier of a peer tier that serves nothing (no ``listen``): it owns
    no key, so it is never asked."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a peer tier without listen owns no key (asked {name})")


class _Pusher(PutQueue):
    """Pushes stored chunks to their owners, a request per owner and batch (split
    at ``max_request_bytes`` and ``MAX_PEER_KEYS``)."""

    def __init__(self, tier: PeerBackend, options: PeerOptions) -> None:
        super().__init__(tier.faults, int(options.max_pending_bytes), "lmkv-peer-push")
        self.tier = tier
        self.max_bytes = int(options.max_request_bytes)

    @property
    def usable(self) -> bool:
        return True

    def _write(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> int:
        tier = self.tier
        serializer = tier.context.serializer
        assert serializer is not None
        by_owner: dict[str, list[tuple[CacheKey, MemoryObj]]] = {}
        for key, obj in zip(keys, objs, strict=True):
            by_owner.setdefault(tier.fleet.owner(key), []).append((key, obj))
        stored = 0
        for owner, items in by_owner.items():
            if tier.links.is_down(owner):
                tier.counters.dropped_writes += len(items)
                continue
            batch: list[CacheKey] = []
            frames: list[bytes] = []
            size = 0
            for key, obj in items:
                frame = b"".join(serializer.serialize(obj, key))
                if batch and (size + len(frame) > self.max_bytes
                              or len(batch) == wire.MAX_PEER_KEYS):
                    stored += self._send(owner, batch, frames)
                    batch, frames, size = [], [], 0
                batch.append(key)
                frames.append(frame)
                size += len(frame)
            if batch:
                stored += self._send(owner, batch, frames)
        tier.counters.puts += stored
        return stored

    def _send(self, owner: str, keys: list[CacheKey], frames: list[bytes]) -> int:
        got = self.tier.links.request(owner, wire.PeerPut(**p.key_fields(keys)), frames)
        if got is None or not isinstance(got[0], wire.PeerPutReply):
            self.tier.counters.dropped_writes += len(keys)
            return 0
        accepted = min(got[0].accepted, len(keys))
        self.tier.counters.dropped_writes += len(keys) - accepted
        self.tier.counters.bytes_in += sum(len(f) for f in frames)
        return accepted
