"""The ``peer`` tier between real storage managers over real ZMQ sockets: one
instance reads what another holds in memory, chunks are pushed to their
owners, and every fault (a peer down, stalled, lying or gone) is a miss."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from lmkv import load_config
from lmkv.base.errors import ConfigError
from lmkv.fleet import wire
from lmkv.fleet.rendezvous import Rendezvous
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import release
from lmkv.rpc import protocol as p
from lmkv.storage import StorageManager

META = KeyMeta("peer-test", dtype="bfloat16")
SHAPE = (2, 2, 16, 2, 8)


def keys(n: int, salt: int = 0) -> list[CacheKey]:
    return [CacheKey(META, bytes([salt]) + i.to_bytes(4, "little") * 4) for i in range(n)]


def peer_config(listen: str | None, peers: list[str], **extra: object) -> dict:
    return {"type": "peer", "options": {"listen": listen, "peers": peers,
                                         "timeout_ms": 300, "retry_after_s": 0.2, **extra}}


def build(listen: str | None, peers: list[str], **extra: object) -> StorageManager:
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        peer_config(listen, peers, **extra)]})
    return StorageManager.from_config(config)


def store(manager: StorageManager, ks: list[CacheKey]) -> None:
    objs = []
    for k in ks:
        obj = manager.allocate(SHAPE, torch.bfloat16)
        assert obj is not None
        obj.tensor.copy_(expected(k))
        objs.append(obj)
    manager.put(ks, objs).result(10)
    release(objs)
    assert manager.flush(10)


def expected(key: CacheKey) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key.chunk_hash[:4], "little"))
    return torch.randn(SHAPE, generator=gen).to(torch.bfloat16)


def read(manager: StorageManager, ks: list[CacheKey]) -> list[bool]:
    """Per key read, whether it came back with its own values (a prefix)."""
    got = manager.get(ks)
    try:
        return [torch.equal(o.tensor, expected(k)) for k, o in zip(ks, got, strict=False)]
    finally:
        release(got)


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[str, str]]:
    run = tmp_path / "run"
    yield f"ipc://{run}/a.sock", f"ipc://{run}/b.sock"


@pytest.fixture
def pair(sockets: tuple[str, str]) -> Iterator[tuple[StorageManager, StorageManager]]:
    a, b = sockets
    first, second = build(a, [a, b]), build(b, [a, b])
    yield first, second
    first.close()
    second.close()


def wait_until(check, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_an_instance_reads_what_another_holds(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    ks = keys(24)
    store(a, ks)
    assert b.contains_prefix(ks) == len(ks)
    assert read(b, ks) == [True] * len(ks)
    peer = b.tiers[1]
    owners = {peer.fleet.owner(k) for k in ks}
    assert len(owners) == 2, "24 keys should fall to both instances"
    from_a = sum(peer.fleet.owner(k) != peer.me for k in ks)
    assert peer.stats()["hits"] >= from_a


def test_chunks_are_pushed_to_their_owners(pair, sockets) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    ks = keys(24, salt=1)
    store(a, ks)
    fleet = Rendezvous(list(sockets))
    owned_by_b = [k for k in ks if fleet.owner(k) == sockets[1]]
    assert owned_by_b
    assert wait_until(lambda: all(b.tiers[0].contains(k) for k in owned_by_b))
    # what a owns stays with a only
    assert not any(b.tiers[0].contains(k) for k in ks if k not in owned_by_b)


def test_owners_do_not_depend_on_the_order_of_the_list() -> None:
    members = ["ipc:///x/a", "ipc:///x/b", "ipc:///x/c"]
    one, other = Rendezvous(members), Rendezvous(list(reversed(members)))
    ks = keys(200, salt=2)
    assert [one.owner(k) for k in ks] == [other.owner(k) for k in ks]
    shares = {m: sum(one.owner(k) == m for k in ks) for m in members}
    assert all(40 < n < 100 for n in shares.values()), shares
    # a member leaving moves only the keys it owned
    fewer = Rendezvous(members[:2])
    moved = [k for k in ks if one.owner(k) != fewer.owner(k)]
    assert all(one.owner(k) == members[2] for k in moved)


def test_another_identity_is_never_served(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    ks = keys(8, salt=3)
    store(a, ks)
    salted = [CacheKey(msgspec.structs.replace(META, model_name="peer-test@salt"), k.chunk_hash)
              for k in ks]
    assert b.contains_prefix(salted) == 0
    assert b.get(salted) == []


def test_a_peer_that_went_away_is_a_miss_and_coming_back_is_a_hit(sockets) -> None:
    a_addr, b_addr = sockets
    a = build(a_addr, [a_addr, b_addr])
    b = build(b_addr, [a_addr, b_addr], push_to_owner=False)
    try:
        ks = keys(16, salt=4)
        store(a, ks)
        fleet = Rendezvous(list(sockets))
        from_a = [k for k in ks if fleet.owner(k) == a_addr]
        a.close()
        start = time.monotonic()
        assert b.contains_prefix(from_a) == 0
        assert b.get(from_a) == []
        assert time.monotonic() - start < 2.0
        a = build(a_addr, [a_addr, b_addr])
        store(a, from_a)
        assert wait_until(lambda: b.contains_prefix(from_a) == len(from_a))
        assert read(b, from_a) == [True] * len(from_a)
    finally:
        a.close()
        b.close()


class FakePeer:
    """A ROUTER socket that answers as ``answer(request, parts)`` says (None: never)."""

    def __init__(self, address: str, answer) -> None:  # type: ignore[no-untyped-def]
        from lmkv.base.private import ipc_dir_problem

        assert ipc_dir_problem(address, create=True) is None
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.answer = answer
        self.asked = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            envelope, header, *parts = self.sock.recv_multipart()
            self.asked += 1
            reply = self.answer(wire.decode_peer_request(header), parts)
            if reply is not None:
                self.sock.send_multipart([envelope, *reply])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.context.term()


def test_a_peer_answering_with_another_keys_frames_is_a_miss(sockets) -> None:
    a_addr, b_addr = sockets
    donor = build(None, [b_addr])  # frames made by a real tier, for other keys
    ks, others = keys(4, salt=5), keys(4, salt=6)
    objs = []
    for k in others:
        obj = donor.allocate(SHAPE, torch.bfloat16)
        obj.tensor.copy_(expected(k))
        objs.append(obj)
    serializer = donor.tiers[1].context.serializer
    frames = [b"".join(serializer.serialize(o, k)) for o, k in zip(objs, others, strict=True)]
    release(objs)
    donor.close()

    removes = []

    def answer(req, parts):  # type: ignore[no-untyped-def]
        n = len(req.cache_keys())
        if isinstance(req, wire.PeerRemove):
            removes.extend(req.cache_keys())
            return [p.encode(wire.PeerRemoveReply(req_id=req.req_id, removed=n))]
        if req.probe:
            return [p.encode(wire.PeerFetchReply(req_id=req.req_id, frames=n))]
        return [p.encode(wire.PeerFetchReply(req_id=req.req_id, frames=n)), *frames[:n]]

    liar = FakePeer(a_addr, answer)
    reader = build(None, [a_addr])
    try:
        assert reader.contains_prefix(ks) == len(ks)  # the probe says yes...
        assert reader.get(ks) == []  # ...and the frames are refused
        assert reader.tiers[1].stats()["corrupt_frames"] >= 1
        assert removes == [], "a frame that fails here says the sides differ: the owner's " \
                              "entry stays"
    finally:
        reader.close()
        liar.close()


def test_a_stalled_peer_costs_one_timeout_then_is_skipped(sockets) -> None:
    a_addr, _ = sockets
    silent = FakePeer(a_addr, lambda req, parts: None)
    reader = build(None, [a_addr], retry_after_s=30)
    try:
        ks = keys(4, salt=7)
        start = time.monotonic()
        assert reader.contains_prefix(ks) == 0
        first = time.monotonic() - start
        assert silent.asked == 1
        start = time.monotonic()
        for _ in range(5):
            assert reader.contains_prefix(ks) == 0
        assert silent.asked == 1, "a peer that timed out is skipped for retry_after_s"
        assert time.monotonic() - start < first
    finally:
        reader.close()
        silent.close()


def test_the_endpoint_survives_bad_requests(pair, sockets) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    ks = keys(4, salt=8)
    store(a, ks)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(sockets[0])
    try:
        def ask(*parts: bytes) -> list[bytes]:
            sock.send_multipart(list(parts))
            assert sock.poll(3000)
            return sock.recv_multipart()

        for bad in (b"garbage", p.encode(p.Ping()),
                    msgspec.msgpack.encode({"op": "peer_fetch", "keys": [[1, 2]]}),
                    p.encode(wire.PeerFetch(**p.key_fields(keys(wire.MAX_PEER_KEYS + 1))))):
            reply = wire.decode_peer_reply(ask(bad)[0])
            assert isinstance(reply, p.ErrorReply) and reply.code == p.BAD_REQUEST
        # a put whose frame count is wrong, and one whose frame is not its key's
        reply = wire.decode_peer_reply(ask(p.encode(wire.PeerPut(**p.key_fields(ks))))[0])
        assert isinstance(reply, p.ErrorReply)
        fresh = keys(1, salt=9)
        fetched = ask(p.encode(wire.PeerFetch(**p.key_fields(ks[:1]))))
        assert wire.decode_peer_reply(fetched[0]).frames == 1
        reply = wire.decode_peer_reply(ask(p.encode(wire.PeerPut(**p.key_fields(fresh))),
                                           fetched[1])[0])
        assert reply.accepted == 0
        assert not a.tiers[0].contains(fresh[0])
        assert a.tiers[1].stats()["rejected_frames"] == 1
        # a message of more parts than any request may hold: refused, not kept
        reply = wire.decode_peer_reply(ask(p.encode(wire.PeerPut(**p.key_fields(fresh))),
                                           *[b"x"] * (wire.MAX_PEER_KEYS + 5))[0])
        assert isinstance(reply, p.ErrorReply) and reply.code == p.TOO_LARGE
        # and it still serves
        assert read(b, ks) == [True] * len(ks)
    finally:
        sock.close(0)
        context.term()


@pytest.mark.parametrize("options, problem", [
    ({"peers": ["tcp://127.0.0.1:5999"]}, "tcp:// without curve"),
    ({"peers": ["ipc:///run/a.sock"], "listen": "ipc:///run/b.sock"}, "is not in peers"),
    ({"peers": ["http://x"]}, "is not ipc:///path/to/socket or tcp://host:port"),
    ({"peers": ["ipc://relative"]}, "needs an absolute path"),
    ({"peers": []}, "at least 1 item"),
])
def test_bad_options_are_one_line(options: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "cpu", "options": {"max_bytes": "1MiB"}},
            {"type": "peer", "options": options}]})
    assert problem in str(info.value)
    assert "\n" not in str(info.value).strip()


def test_serving_needs_a_memory_tier(sockets) -> None:
    config = load_config(env={}, overrides={"lmkv.tiers": [
        peer_config(sockets[0], [sockets[0]])]})
    with pytest.raises(ConfigError, match="serving peers needs a tier that holds memory"):
        StorageManager.from_config(config)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_peers_need_each_others_keys(tmp_path: Path) -> None:
    from lmkv.rpc.auth import write_keypair

    _, fleet_secret = write_keypair(tmp_path / "keys", "fleet")
    _, stranger_secret = write_keypair(tmp_path / "keys", "stranger")
    a, b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    holder = build(a, [a, b], curve={"secret_key": str(fleet_secret)}, push_to_owner=False)
    reader = build(b, [a, b], curve={"secret_key": str(fleet_secret)})
    stranger = build(None, [a, b], curve={"secret_key": str(stranger_secret)})
    try:
        ks = keys(24, salt=11)
        store(holder, ks)
        from_a = [k for k in ks if reader.tiers[1].fleet.owner(k) == a]
        assert read(reader, from_a) == [True] * len(from_a)
        # a key pair the holder does not know never completes the handshake: misses
        start = time.monotonic()
        assert stranger.contains_prefix(from_a) == 0
        assert stranger.get(from_a) == []
        assert time.monotonic() - start < 3.0
        assert holder.tiers[1].endpoint.served >= len(from_a)
    finally:
        for manager in (stranger, reader, holder):
            manager.close()


def test_a_second_process_cannot_take_an_address_over(sockets) -> None:
    a, b = sockets
    first = build(a, [a, b])
    try:
        with pytest.raises(ConfigError, match="another process serves it"):
            build(a, [a, b])
        ks = [k for k in keys(16, salt=12) if Rendezvous([a, b]).owner(k) == a]
        store(first, ks)
        reader = build(b, [a, b])
        try:
            assert read(reader, ks) == [True] * len(ks), "the first still serves"
        finally:
            reader.close()
    finally:
        first.close()
    build(a, [a, b]).close()  # free again once it is closed


def test_a_push_of_a_key_this_instance_does_not_own_is_refused(pair, sockets) -> None:
    a, b = pair
    mine = [k for k in keys(16, salt=13) if a.tiers[1].fleet.owner(k) == sockets[0]]
    store(a, mine)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(sockets[1])  # b does not own these
    try:
        fetched = []
        for key in mine[:2]:
            got = a.tiers[0].get_blocking(key)
            fetched.append(b"".join(a.tiers[1].context.serializer.serialize(got, key)))
            got.ref_down()
        sock.send_multipart([p.encode(wire.PeerPut(**p.key_fields(mine[:2]))), *fetched])
        assert sock.poll(3000)
        reply = wire.decode_peer_reply(sock.recv_multipart()[0])
        assert reply.accepted == 0
        assert not any(b.tiers[0].contains(k) for k in mine[:2])
    finally:
        sock.close(0)
        context.term()


def test_every_reference_goes_back(pair) -> None:  # type: ignore[no-untyped-def]
    """After reads, pushes, a refused frame and close, the memory tiers' entries
    are held by the tiers alone (no buffer leaked by a peer path)."""
    a, b = pair
    ks = keys(24, salt=14)
    store(a, ks)
    assert read(b, ks) == [True] * len(ks)
    assert b.contains_prefix(ks) == len(ks)
    for manager in (a, b):
        memory = manager.tiers[0]
        assert wait_until(lambda m=memory: all(refs == (1, 0) for refs in
                                                m.entry_refs())), memory.entry_refs()
