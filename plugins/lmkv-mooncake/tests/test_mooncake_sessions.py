"""Put and get sessions (Mooncake's ranged calls) against a real master: the
direct path reads and writes through them, checks every frame as before, never
takes an object of another size, and never leaves half an entry readable."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from test_mooncake_failed_gets import failing, short_timeout, slow
from test_mooncake_faults import chunk, eventually, key, put, read

from lmkv.contracts import tensor_obj
from lmkv.testing.tiers import serializer

pytestmark = pytest.mark.slow  # a real mooncake_master

PUT_RANGES = "batch_put_from_multi_buffer_ranges"


def frame(i: int) -> bytes:
    return b"".join(bytes(b) for b in serializer("naive").serialize(tensor_obj(chunk(i)), key(i)))


def put_arena(tier: Any, ids: list[int]) -> int:
    """Chunks ``ids`` put from lmkv's arena (registered: what put sessions read)."""
    objs = []
    for i in ids:
        obj = tier.context.allocate(chunk(i).shape, chunk(i).dtype)
        obj.tensor.copy_(chunk(i))
        objs.append(obj)
    try:
        return tier.batched_submit_put([key(i) for i in ids], objs).result(timeout=60)
    finally:
        for obj in objs:
            obj.ref_down()


def store_raw(tier: Any, i: int, value: bytes) -> None:
    """``value`` stored under chunk ``i``'s name, as another writer could."""
    with tier.link.using() as store:
        name = tier.store_key(key(i))
        store.remove(name, True)
        assert store.put(name, value) == 0


def test_direct_gets_read_through_one_get_session(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    assert put(tier, [1, 2, 3, 4]) == 4
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    store = failing(tier, monkeypatch, batch_get_session_start=lambda codes: codes)
    got = tier.batched_get_non_blocking("l", [key(2), key(3), key(4)]).result(timeout=60)
    try:
        assert [torch.equal(o.tensor, chunk(i)) for o, i in zip(got, [2, 3, 4], strict=True)] \
            == [True] * 3
    finally:
        for obj in got:
            obj.ref_down()
    assert store.calls == ["batch_get_session_start"]
    assert tier.stats()["direct_gets"] >= 3


@pytest.mark.parametrize("extra", [1, 4096])
def test_an_object_larger_than_the_guess_is_never_taken_direct(
        make_tier: Any, shared_client: None, extra: int) -> None:
    """A whole valid frame with bytes after it: every range the guess asks for
    reads back right, so only the byte past the guess tells it apart. It is read
    the staged way, which finds the frame corrupt by its own length."""
    tier = make_tier()
    assert put(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    store_raw(tier, 2, frame(2) + b"x" * extra)
    corrupt = tier.stats()["corrupt_frames"]
    assert read(tier, 2) is None
    assert tier.stats()["corrupt_frames"] == corrupt + 1
    assert not tier.contains(key(2))  # dropped


def test_a_shorter_object_is_read_staged_and_a_corrupt_payload_is_a_miss(
        make_tier: Any, shared_client: None) -> None:
    tier = make_tier()
    assert put(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))
    store_raw(tier, 2, frame(2)[:-100])  # refused by the ranged read, corrupt staged
    store_raw(tier, 3, frame(3)[:-1] + bytes([frame(3)[-1] ^ 1]))  # last payload byte
    assert read(tier, 2) is None
    assert read(tier, 3) is None
    assert tier.stats()["corrupt_frames"] == 2
    # Several keys in one window, the corrupt one among them: each its own digest.
    store_raw(tier, 3, frame(3)[:-1] + bytes([frame(3)[-1] ^ 1]))
    store_raw(tier, 5, frame(5))
    store_raw(tier, 6, frame(6))
    got = tier.batched_get_non_blocking("l", [key(5), key(6), key(3)]).result(timeout=60)
    try:
        assert [torch.equal(o.tensor, chunk(i)) for o, i in zip(got, [5, 6], strict=True)] \
            == [True, True]
    finally:
        for obj in got:
            obj.ref_down()
    assert tier.stats()["corrupt_frames"] == 3
    store_raw(tier, 4, frame(4))  # the same bytes whole: read, direct
    direct = tier.stats()["direct_gets"]
    assert torch.equal(read(tier, 4), chunk(4))
    assert tier.stats()["direct_gets"] == direct + 1


def test_gets_of_the_same_keys_at_once_never_end_each_others_session(
        make_tier: Any, shared_client: None) -> None:
    """Mooncake keeps one get session per key and client: a get whose keys have
    one open reads the batch way instead, and every get answers every chunk."""
    tier = make_tier()
    ids = list(range(1, 7))
    assert put(tier, ids) == len(ids)
    assert torch.equal(read(tier, 1), chunk(1))
    names = [tier.store_key(key(i)) for i in ids]
    assert tier.link.claim_sessions(names[:2])
    assert not tier.link.claim_sessions(names[1:3])  # one of them is held
    tier.link.release_sessions(names[:2])
    assert tier.link.claim_sessions(names[1:3])
    tier.link.release_sessions(names[1:3])
    wrong: list[str] = []

    def reader() -> None:
        for _ in range(10):
            got = tier.batched_get_non_blocking("l", [key(i) for i in ids]).result(timeout=60)
            if len(got) != len(ids):
                wrong.append(f"{len(got)} of {len(ids)}")
            for obj, i in zip(got, ids, strict=False):
                if not torch.equal(obj.tensor, chunk(i)):
                    wrong.append(f"chunk {i}")
                obj.ref_down()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert wrong == []
    assert tier.stats()["errors"] == 0


def test_puts_go_through_one_put_session(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One start, the payloads' and the headers' ranged calls, one end, and no
    ``batch_is_exist`` first: the start answers OBJECT_ALREADY_EXISTS for an
    entry already there, and nothing of it is sent."""
    tier = make_tier()

    def same(answer: Any) -> Any:
        return answer

    store = failing(tier, monkeypatch, **dict.fromkeys(
        ["batch_is_exist", "batch_put_session_start", PUT_RANGES, "batch_put_session_end"],
        same))
    assert put_arena(tier, [1, 2, 3]) == 3
    assert store.calls == ["batch_put_session_start", PUT_RANGES, PUT_RANGES,
                           "batch_put_session_end"]
    monkeypatch.undo()
    for i in (1, 2, 3):
        assert torch.equal(read(tier, i), chunk(i))
    store = failing(tier, monkeypatch, **dict.fromkeys(
        ["batch_is_exist", "batch_put_session_start", PUT_RANGES], same))
    puts = tier.stats()["puts"]
    assert put_arena(tier, [1, 2, 4]) == 3  # 1 and 2 present: not sent again
    assert store.calls == ["batch_put_session_start", PUT_RANGES, PUT_RANGES]
    assert tier.stats()["dropped_writes"] == 0
    assert tier.stats()["puts"] == puts + 3
    assert torch.equal(read(tier, 4), chunk(4))


@pytest.mark.parametrize("fails", ["payloads", "headers", "end", "late"])
def test_a_put_session_that_fails_leaves_nothing_readable_and_gives_the_space_back(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        fails: str) -> None:
    """Payloads or headers that did not arrive, a session that would not end, or a
    call past ``call_timeout_s``: the entries are revoked (the same keys can be
    put again at once, which a session left open refuses) and the writes count
    as dropped."""
    tier = make_tier()
    header_len = len(frame(1)) - chunk(1).numel() * 2

    def ranges(codes: list[int]) -> list[int]:
        # (the payloads' and the headers' calls may answer in either order)
        headers = all(code == header_len for code in codes)
        if fails in ("payloads", "headers") and headers == (fails == "headers"):
            return [-800] * len(codes)
        return codes

    fail: dict[str, Any] = {PUT_RANGES: ranges}
    instead = {}
    if fails == "end":  # refused: the entries stay reserved, not readable
        instead["batch_put_session_end"] = lambda names: [-600] * len(names)
    if fails == "late":
        short_timeout(tier, monkeypatch)
        fail[PUT_RANGES] = slow(1)
    failing(tier, monkeypatch, instead=instead, **fail)
    dropped = tier.stats()["dropped_writes"]
    assert put_arena(tier, [1, 2]) == 0
    assert tier.stats()["dropped_writes"] == dropped + 2
    monkeypatch.undo()  # the real store, the default call_timeout_s
    assert not tier.contains(key(1)) and not tier.contains(key(2))
    assert eventually(lambda: put_arena(tier, [1, 2]) == 2, 10)  # (past the breaker's backoff)
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_payload_that_changed_under_its_header_is_never_readable(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header is computed while the payload moves; the chunk's bytes must be
    the ones moved. A serializer whose payload is not the chunk's own bytes is
    refused for that entry (revoked), never stored under a header of other bytes."""
    tier = make_tier()
    serializer = tier._writer.serializer
    real = serializer.serialize

    def copied(obj: Any, k: Any) -> list[Any]:
        header, payload = real(obj, k)
        return [header, bytes(payload)]  # the right bytes, elsewhere in memory

    monkeypatch.setattr(serializer, "serialize", copied)
    assert put_arena(tier, [1]) == 0
    monkeypatch.undo()
    assert not tier.contains(key(1))
    assert put_arena(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))


def test_a_revoke_the_master_did_not_answer_is_retried_before_the_next_put(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake keeps a put session whose revoke failed, and refuses any later
    session of that key in this process: the tier revokes it again first."""
    tier = make_tier()
    failing(tier, monkeypatch, instead={
        "batch_put_session_revoke": lambda names: [-900] * len(names)},
        **{PUT_RANGES: lambda codes: [-800] * len(codes)})
    assert put_arena(tier, [1, 2]) == 0
    monkeypatch.undo()
    assert eventually(lambda: put_arena(tier, [1, 2]) == 2, 10)
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def session_start(tier: Any, names: list[str], sizes: list[int]) -> list[int]:
    """A put session opened on ``names`` as another call of this process could."""
    from lmkv_mooncake.client import replicate_config

    with tier.link.using() as store:
        return store.batch_put_session_start(names, sizes, replicate_config(tier.link.options))


@pytest.mark.parametrize(("shape", "dtype"), [
    ((3, 5), torch.float16), ((7, 3, 3), torch.float32), ((1,), torch.bfloat16)])
def test_chunks_of_any_size_go_through_put_and_get_sessions(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A chunk's arena block is rounded up; the session moves the chunk's own
    bytes, whatever its size."""
    tier = make_tier()
    store = failing(tier, monkeypatch, batch_put_session_start=lambda codes: codes)
    values = {i: torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)
              for i in (1, 2, 3)}
    objs = []
    for value in values.values():
        obj = tier.context.allocate(shape, dtype)
        obj.tensor.copy_(value)
        objs.append(obj)
    try:
        assert tier.batched_submit_put([key(i) for i in values], objs).result(timeout=60) == 3
    finally:
        for obj in objs:
            obj.ref_down()
    assert store.calls == ["batch_put_session_start"]
    assert tier.stats()["dropped_writes"] == 0
    for i, value in values.items():  # the first learns the layout, the rest read direct
        obj = tier.get_blocking(key(i))
        assert obj is not None
        try:
            assert obj.tensor.dtype == dtype and torch.equal(obj.tensor, value)
        finally:
            obj.ref_down()
    assert tier.stats()["direct_gets"] >= 2


@pytest.mark.parametrize("late", ["answer", "work"])
def test_a_session_start_past_call_timeout_s_never_locks_its_keys_out(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        late: str) -> None:
    """A start that answered too late may have opened its sessions, before its
    answer or after it: they are revoked before the next put, which stores the
    keys."""
    tier = make_tier()
    short_timeout(tier, monkeypatch)
    if late == "answer":  # opened at once, answered 1 s later
        failing(tier, monkeypatch, batch_put_session_start=slow(1))
    else:  # opened 1 s later
        real: dict[str, Any] = {}

        def start(*args: Any) -> Any:
            time.sleep(1)
            return real["store"].batch_put_session_start(*args)

        real["store"] = failing(tier, monkeypatch,
                                instead={"batch_put_session_start": start})._store
    assert put_arena(tier, [1, 2]) == 0
    time.sleep(1.5)  # the late start is over
    monkeypatch.undo()
    assert eventually(lambda: put_arena(tier, [1, 2]) == 2, 10)
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_revoke_of_an_entry_the_master_holds_whole_ends_it(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An end whose answer was lost leaves the session open here and the entry
    whole on the master, which then refuses a revoke (INVALID_WRITE): the entry
    is ended again (only whole entries are ever ended), never left locked."""
    tier = make_tier()
    real: dict[str, Any] = {}
    ends = [0]

    def end(names: list[str]) -> list[int]:
        ends[0] += 1
        if ends[0] == 1:  # lost on its way: the master never saw it
            return [-900] * len(names)
        return real["store"].batch_put_session_end(names)

    real["store"] = failing(tier, monkeypatch, instead={
        "batch_put_session_end": end,
        "batch_put_session_revoke": lambda names: [-700] * len(names)})._store
    dropped = tier.stats()["dropped_writes"]
    assert put_arena(tier, [1, 2]) == 2  # stored after all
    assert tier.stats()["dropped_writes"] == dropped
    monkeypatch.undo()
    assert ends[0] == 2
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_put_session_left_open_is_revoked_and_its_key_put_again(
        make_tier: Any, shared_client: None) -> None:
    """A session this process left open (a revoke the master refused, a call that
    answered late) makes the start of that key answer INVALID_PARAMS: that write
    is dropped, the session revoked by the same put, and the next put stores
    the key."""
    tier = make_tier()
    name = tier.store_key(key(1))
    assert session_start(tier, [name], [100]) == [0]
    errors = tier.stats()["errors"]
    assert put_arena(tier, [1, 2]) == 1
    assert not tier.contains(key(1)) and torch.equal(read(tier, 2), chunk(2))
    assert tier.stats()["errors"] == errors  # not a refused write: a note
    assert session_start(tier, [name], [100]) == [0]  # revoked already: it opens
    with tier.link.using() as store:
        assert store.batch_put_session_revoke([name]) == [0]
    assert put_arena(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))


def test_a_start_refusing_its_parameters_is_a_fault_not_a_session_left_open(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """INVALID_PARAMS from a start is a session of the key left open, or the
    parameters refused: the revoke tells them apart (no session to revoke)."""
    tier = make_tier()
    failing(tier, monkeypatch, instead={
        "batch_put_session_start": lambda names, sizes, config: [-600] * len(names)})
    errors = tier.stats()["errors"]
    with caplog.at_level(logging.WARNING):
        assert put_arena(tier, [1, 2]) == 0
    assert tier.stats()["errors"] == errors + 1
    assert "INVALID_PARAMS" in caplog.text and "left open" not in caplog.text
    assert not tier.link._client.unsettled
    monkeypatch.undo()
    assert put_arena(tier, [1, 2]) == 2


@pytest.mark.parametrize("code", [-700, -601, -600])  # INVALID_WRITE, ILLEGAL_CLIENT, ...
def test_a_revoke_refused_never_ends_an_entry_whose_end_was_never_asked_for(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        code: int) -> None:
    """Payloads that did not arrive: the entries are revoked, never ended, what
    the revoke answers; the sessions it left open are revoked by later puts."""
    tier = make_tier()
    ends: list[list[str]] = []
    real: dict[str, Any] = {}

    def end(names: list[str]) -> list[int]:
        ends.append(names)
        return real["store"].batch_put_session_end(names)

    real["store"] = failing(tier, monkeypatch, instead={
        "batch_put_session_revoke": lambda names: [code] * len(names),
        "batch_put_session_end": end},
        **{PUT_RANGES: lambda codes: [-800] * len(codes)})._store
    assert put_arena(tier, [1, 2]) == 0
    assert ends == []
    assert not tier.contains(key(1)) and not tier.contains(key(2))
    monkeypatch.undo()
    assert eventually(lambda: put_arena(tier, [1, 2]) == 2, 10)
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_writers_sharing_one_client_put_the_same_keys_at_once(
        make_tier: Any, shared_client: None) -> None:
    """Two tiers of one process (one Mooncake client: one put session per key)
    under the same key prefix, putting overlapping keys from several threads:
    every key ends up stored with its own bytes, and no put fails."""
    prefix = f"shared-{time.monotonic_ns()}:"
    tiers = [make_tier(key_prefix=prefix), make_tier(key_prefix=prefix)]
    errors = [t.stats()["errors"] for t in tiers]
    wrong: list[str] = []

    def writer(tier: Any, ids: list[int]) -> None:
        for _ in range(3):
            try:
                put_arena(tier, ids)
            except Exception as exc:  # (reported by the assert below)
                wrong.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(t, ids))
               for t in tiers for ids in ([1, 2, 3, 4], [3, 4, 5, 6], [6, 1, 2, 7])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert wrong == []
    assert [t.stats()["errors"] for t in tiers] == errors
    assert not tiers[0].link._client.puts  # every claim given back
    for i in range(1, 8):
        assert eventually(lambda i=i: put_arena(tiers[0], [i]) == 1, 10)
        for tier in tiers:
            assert torch.equal(read(tier, i), chunk(i))


def test_a_key_twice_in_one_put_is_sent_once(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    started: list[list[str]] = []
    real: dict[str, Any] = {}

    def start(names: list[str], *args: Any) -> Any:
        started.append(list(names))
        return real["store"].batch_put_session_start(names, *args)

    real["store"] = failing(tier, monkeypatch, instead={"batch_put_session_start": start})._store
    objs = []
    for i in (1, 2, 1):
        obj = tier.context.allocate(chunk(i).shape, chunk(i).dtype)
        obj.tensor.copy_(chunk(i))
        objs.append(obj)
    try:
        assert tier.batched_submit_put([key(1), key(2), key(1)], objs).result(timeout=60) == 3
    finally:
        for obj in objs:
            obj.ref_down()
    assert started == [[tier.store_key(key(1)), tier.store_key(key(2))]]
    assert tier.stats()["dropped_writes"] == 0 and tier.stats()["errors"] == 0
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_put_never_touches_a_put_session_another_writer_holds(
        make_tier: Any, shared_client: None) -> None:
    """Put sessions are per key and client: a key another writer of this process
    is putting is dropped here, never started, ended or revoked under it."""
    tier = make_tier()
    name = tier.store_key(key(1))
    assert tier.link.claim_puts([name]) == {name}
    assert session_start(tier, [name], [100]) == [0]  # that writer's session
    try:
        assert put_arena(tier, [1, 2]) == 1
        assert tier.link.claim_puts([name]) == set()
    finally:
        tier.link.release_puts([name], {name: False})  # left open: settled by the next put
    assert not tier.contains(key(1))
    assert put_arena(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))


def test_no_staging_room_for_the_headers_drops_the_window_and_says_so(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = make_tier()
    monkeypatch.setattr(tier._writer, "staging", _NoRoom(tier._writer.staging))
    with caplog.at_level(logging.WARNING):
        assert put_arena(tier, [1, 2]) == 0
    assert "no room in the staging buffer" in caplog.text
    assert "see Mooncake's log" not in caplog.text
    monkeypatch.undo()
    assert put_arena(tier, [1, 2]) == 2


class _NoRoom:
    """A staging allocator that is full."""

    def __init__(self, staging: Any) -> None:
        self._staging = staging

    def allocate(self, *args: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._staging, name)


@pytest.mark.parametrize("code", [-702, -707])  # INVALID_REPLICA, LEASE_EXPIRED
def test_a_get_session_refused_for_its_replica_or_lease_reads_staged(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        code: int) -> None:
    tier = make_tier()
    assert put(tier, [1, 2]) == 2
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    failing(tier, monkeypatch, batch_get_session_start=lambda codes: [code] * len(codes))
    assert torch.equal(read(tier, 2), chunk(2))
    assert tier.stats()["errors"] == 0


@pytest.mark.parametrize("how", ["session", "batch", "staged"])
def test_a_get_of_an_entry_still_being_written_is_a_miss(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    """An entry whose put has not ended (REPLICA_IS_NOT_READY, refused before
    any transfer): a miss, not an error, nothing quarantined."""
    from test_mooncake_failed_gets import SESSIONS

    tier = make_tier()
    assert put(tier, [1]) == 1
    if how != "staged":
        assert torch.equal(read(tier, 1), chunk(1))  # learns the layout: direct gets
    name = tier.store_key(key(2))
    assert session_start(tier, [name], [len(frame(2))]) == [0]  # another writer's put
    try:
        if how == "batch":
            failing(tier, monkeypatch, hide=SESSIONS)
        errors = tier.stats()["errors"]
        assert read(tier, 2) is None
        assert tier.stats()["errors"] == errors
        assert tier.stats()["quarantined_chunks"] == 0
        assert not tier.faults.breaker.is_open
    finally:
        monkeypatch.undo()
        with tier.link.using() as store:
            assert store.batch_put_session_revoke([name]) == [0]
    assert put(tier, [2]) == 1
    assert torch.equal(read(tier, 2), chunk(2))


def test_copies_of_a_key_count_as_that_entry_turned_out(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    failing(tier, monkeypatch, **{PUT_RANGES: lambda codes: [-800] * len(codes)})
    puts, dropped = tier.stats()["puts"], tier.stats()["dropped_writes"]
    assert put_arena(tier, [1, 1, 1]) == 0  # the one sent did not arrive: none stored
    assert tier.stats()["puts"] == puts
    assert tier.stats()["dropped_writes"] == dropped + 3
    monkeypatch.undo()
    assert eventually(lambda: put_arena(tier, [1, 2, 1]) == 3, 10)
    assert torch.equal(read(tier, 1), chunk(1))


def test_an_end_whose_answer_was_lost_counts_as_stored_when_the_revoke_finds_none(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end went through (Mooncake closed the session) but its answer was
    lost: the revoke finds no session (INVALID_PARAMS), so the entry is stored."""
    tier = make_tier()
    real: dict[str, Any] = {}

    def end(names: list[str]) -> list[int]:
        assert real["store"].batch_put_session_end(names) == [0] * len(names)
        return [-900] * len(names)

    real["store"] = failing(tier, monkeypatch,
                            instead={"batch_put_session_end": end})._store
    dropped = tier.stats()["dropped_writes"]
    assert put_arena(tier, [1, 2]) == 2
    assert tier.stats()["dropped_writes"] == dropped
    monkeypatch.undo()
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_later_put_ends_again_an_entry_whose_end_and_revoke_went_unanswered(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end's answer lost, then the revoke's: the session may be open and the
    entry whole; the next put's settling meets INVALID_WRITE and ends it again
    (and only then), so the key is never locked out."""
    tier = make_tier()
    real: dict[str, Any] = {}
    ends: list[list[str]] = []

    def end_lost(names: list[str]) -> list[int]:
        ends.append(list(names))
        return [-900] * len(names)  # (never reached the master)

    real["store"] = failing(tier, monkeypatch, instead={
        "batch_put_session_end": end_lost,
        "batch_put_session_revoke": lambda names: [-900] * len(names)})._store
    assert put_arena(tier, [1]) == 0
    assert tier.link._client.unsettled == {tier.store_key(key(1)): True}
    monkeypatch.undo()

    def end(names: list[str]) -> list[int]:
        ends.append(list(names))
        return real["store"].batch_put_session_end(names)

    failing(tier, monkeypatch, instead={
        "batch_put_session_end": end,
        "batch_put_session_revoke": lambda names: [-700] * len(names)})
    ends.clear()
    assert put_arena(tier, [2]) == 1  # settles key 1 first
    assert [tier.store_key(key(1))] in ends  # ended again by the settling
    assert not tier.link._client.unsettled
    monkeypatch.undo()
    assert torch.equal(read(tier, 1), chunk(1)) and torch.equal(read(tier, 2), chunk(2))


def test_a_master_gone_while_settling_opens_the_breaker(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmkv_mooncake.client import MasterUnreachable

    tier = make_tier()
    failing(tier, monkeypatch, instead={
        "batch_put_session_revoke": lambda names: [-900] * len(names)},
        **{PUT_RANGES: lambda codes: [-800] * len(codes)})
    assert put_arena(tier, [1]) == 0
    assert not tier.faults.breaker.is_open
    monkeypatch.undo()

    def gone(names: list[str]) -> list[int]:
        raise MasterUnreachable("batch_put_session_revoke did not answer")

    store = failing(tier, monkeypatch, batch_put_session_start=lambda codes: codes,
                    instead={"batch_put_session_revoke": gone})
    assert put_arena(tier, [2]) == 0
    assert tier.faults.breaker.is_open
    assert store.calls == ["batch_put_session_revoke"]  # no start after it
    assert tier.store_key(key(1)) in tier.link._client.unsettled  # still to settle
    monkeypatch.undo()
    assert eventually(lambda: put_arena(tier, [1, 2]) == 2, 10)
