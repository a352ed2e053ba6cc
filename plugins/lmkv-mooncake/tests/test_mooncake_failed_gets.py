"""Gets whose transfer or call fails: buffers the store may still write into
stay out of the arena, RPC-class failures open the breaker, and a frame of
another layout is never dropped by the direct path. Direct gets go through
get sessions (ranged calls) where the store has them, and through one batch
call where it has not (``SESSIONS`` hidden): both ways are tested."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from test_mooncake_faults import chunk, key, put, read

from lmkv.contracts import tensor_obj

pytestmark = pytest.mark.slow  # a real mooncake_master

#: The store's get-session calls: hidden, a store without them (the batch call).
SESSIONS = ("batch_get_session_start", "batch_get_into_multi_buffer_ranges")
RANGES = "batch_get_into_multi_buffer_ranges"
BATCH = "batch_get_into_multi_buffers"


class FailingStore:
    """The real store, but the named get calls answer ``fail`` after doing
    their work (a transfer that failed late, or is still running), the
    ``instead`` ones answer without it, and the ``hide`` ones are not there."""

    def __init__(self, store: Any, fail: dict[str, Callable[[Any], Any]],
                 hide: tuple[str, ...] = (),
                 instead: dict[str, Callable[..., Any]] | None = None) -> None:
        self._store = store
        self._fail = fail
        self._hide = hide
        self._instead = instead or {}
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in self._hide:
            raise AttributeError(name)
        if name in self._instead:  # answered without the store doing anything
            self.calls.append(name)
            return self._instead[name]
        real = getattr(self._store, name)
        if name not in self._fail:
            return real

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return self._fail[name](real(*args))
        return call


def failing(tier: Any, monkeypatch: pytest.MonkeyPatch, hide: tuple[str, ...] = (),
            instead: dict[str, Callable[..., Any]] | None = None,
            **fail: Callable[[Any], Any]) -> FailingStore:
    using = tier.link.using
    holder: dict[str, FailingStore] = {}

    @contextmanager
    def wrapped(breaker: bool = True) -> Iterator[Any]:
        with using(breaker) as store:
            proxy = holder.setdefault("store", FailingStore(store, fail, hide, instead))
            yield proxy

    monkeypatch.setattr(tier.link, "using", wrapped)
    with tier.link.using() as store:
        return store


def test_a_failed_direct_get_quarantines_its_buffers(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    assert put(tier, [1, 2, 3]) == 3
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    arena = tier.context.allocate.__self__
    used = arena.used_bytes
    store = failing(tier, monkeypatch, hide=SESSIONS,
                    batch_get_into_multi_buffers=lambda codes: [-800] * len(codes))
    assert tier.batched_get_non_blocking("l", [key(2), key(3)]).result(timeout=60) == []
    assert store.calls == [BATCH]  # not retried staged
    # The store may still be writing into them: not reused by another chunk.
    assert arena.used_bytes == used + 2 * chunk(2).numel() * 2
    assert tier.stats()["quarantined_chunks"] == 2
    assert tier.faults.breaker.is_open  # TRANSFER_FAIL: the path to the data is gone


def test_a_ranged_get_that_answers_a_failure_gives_its_buffers_back(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranged call answers once its transfer is over, failed or not: nothing
    can write into the buffers after it, so they go back to the arena."""
    tier = make_tier()
    assert put(tier, [1, 2, 3]) == 3
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    arena = tier.context.allocate.__self__
    used = arena.used_bytes
    store = failing(tier, monkeypatch, **{RANGES: lambda codes: [-800] * len(codes)})
    assert tier.batched_get_non_blocking("l", [key(2), key(3)]).result(timeout=60) == []
    assert store.calls == [RANGES]  # the first ranged call; not retried staged
    assert arena.used_bytes == used
    assert tier.stats()["quarantined_chunks"] == 0
    assert tier.faults.breaker.is_open


@pytest.mark.parametrize("code", [-900, -1010])
@pytest.mark.parametrize("call", [BATCH, RANGES, "batch_get_session_start"])
def test_an_rpc_failure_of_a_direct_get_opens_the_breaker(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        code: int, call: str) -> None:
    tier = make_tier()
    assert put(tier, [1, 2]) == 2
    assert torch.equal(read(tier, 1), chunk(1))
    errors = tier.stats()["errors"]
    store = failing(tier, monkeypatch, hide=SESSIONS if call == BATCH else (),
                    **{call: lambda codes: [code] * len(codes)})
    assert read(tier, 2) is None
    assert store.calls == [call]
    assert tier.faults.breaker.is_open
    assert tier.stats()["errors"] == errors + 1


def test_a_staged_get_that_fails_is_a_fault_not_a_silent_miss(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    assert put(tier, [1]) == 1
    store = failing(tier, monkeypatch, batch_get_buffer=lambda handles: [None] * len(handles))
    assert read(tier, 1) is None  # the entry exists: its get failed
    assert tier.stats()["errors"] == 1 and not tier.faults.breaker.is_open
    assert read(tier, 5) is None  # absent: a plain miss
    assert tier.stats()["errors"] == 1
    store._fail["is_exist"] = lambda code: -900  # the master does not answer
    assert read(tier, 1) is None
    assert tier.faults.breaker.is_open


def test_quarantined_buffers_are_freed_once_the_store_is_closed(
        mooncake_master: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_helpers import new_tier

    from lmkv_mooncake.client import join_closing

    tier = new_tier(mooncake_master, global_segment_size="16MiB")  # its own client
    try:
        assert put(tier, [1, 2]) == 2
        assert torch.equal(read(tier, 1), chunk(1))
        arena = tier.context.allocate.__self__
        used = arena.used_bytes
        failing(tier, monkeypatch, hide=SESSIONS,
                batch_get_into_multi_buffers=lambda codes: [-1] * len(codes))
        assert read(tier, 2) is None
        assert arena.used_bytes > used
    finally:
        tier.close()
    assert join_closing(30)
    assert arena.used_bytes == used


def test_a_missing_or_resized_frame_gives_its_buffers_back(
        make_tier: Any, shared_client: None) -> None:
    tier = make_tier()
    assert put(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))
    arena = tier.context.allocate.__self__
    used = arena.used_bytes
    other = torch.arange(64, dtype=torch.float32).reshape(4, 16)
    assert tier.batched_submit_put([key(9)], [tensor_obj(other)]).result(timeout=60) == 1
    assert read(tier, 8) is None  # not found
    assert torch.equal(read(tier, 9), other)  # another size: staged
    assert arena.used_bytes == used
    assert tier.stats()["quarantined_chunks"] == 0


def test_a_valid_frame_with_a_longer_header_is_read_staged_not_dropped(
        make_tier: Any, shared_client: None) -> None:
    """Six dimensions (a header 8 bytes longer) and a payload 8 bytes shorter: the
    frame has the chunk layout's total size, so the direct read gets it whole and
    its guessed header is truncated."""
    tier = make_tier()
    assert put(tier, [1]) == 1
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    other = torch.arange(4092, dtype=torch.float16).reshape(1, 1, 1, 1, 4, 1023)
    assert other.numel() * 2 == chunk(1).numel() * 2 - 8
    assert tier.batched_submit_put([key(9)], [tensor_obj(other)]).result(timeout=60) == 1
    assert torch.equal(read(tier, 9), other)
    assert tier.stats()["corrupt_frames"] == 0
    assert tier.contains(key(9))


def slow(seconds: float) -> Callable[[Any], Any]:
    import time

    def answer(result: Any) -> Any:
        time.sleep(seconds)
        return result
    return answer


def short_timeout(tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``call_timeout_s`` of 0.3 s from now on (set up under the default: a loaded
    machine must not time out the setup's calls)."""
    monkeypatch.setattr(tier.link, "options",
                        tier.link.options.model_copy(update={"call_timeout_s": 0.3}))


def slow_after(calls: int, seconds: float) -> Callable[[Any], Any]:
    """Answers the first ``calls`` calls at once, the later ones ``seconds`` late."""
    seen = [0]

    def answer(result: Any) -> Any:
        seen[0] += 1
        return slow(seconds)(result) if seen[0] > calls else result
    return answer


@pytest.mark.parametrize(("call", "chunks"), [(BATCH, 1), (RANGES, 1), ("probe", 0)])
def test_a_call_past_call_timeout_s_opens_the_breaker_and_quarantines(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        call: str, chunks: int) -> None:
    """The chunk buffers a late transfer may write into are quarantined; a late
    probe (a get session's first ranged call, one byte into the header staging)
    leaves the chunk buffers alone: they are not even taken yet."""
    tier = make_tier()
    assert put(tier, [1, 2]) == 2
    assert torch.equal(read(tier, 1), chunk(1))  # learns the layout
    short_timeout(tier, monkeypatch)
    answer = slow(2) if call != RANGES else slow_after(1, 2)  # the probe, then a piece
    failing(tier, monkeypatch, hide=SESSIONS if call == BATCH else (),
            **{BATCH if call == BATCH else RANGES: answer})
    held = len(tier.link._client.quarantined)
    assert read(tier, 2) is None
    assert tier.faults.breaker.is_open
    assert tier.stats()["quarantined_chunks"] == chunks  # the transfer may still run
    # and the header staging block it may write into (the probe's only buffer)
    assert len(tier.link._client.quarantined) == held + chunks + 1


def test_a_slow_lookup_is_a_miss_and_opens_the_breaker(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier()
    assert put(tier, [1]) == 1
    short_timeout(tier, monkeypatch)
    failing(tier, monkeypatch, batch_is_exist=slow(2))
    assert tier.batched_async_contains("l", [key(1)]) == 0
    assert tier.faults.breaker.is_open


@pytest.mark.parametrize("code", [-702, -707])  # INVALID_REPLICA, LEASE_EXPIRED
def test_a_batch_get_refused_for_its_replica_or_lease_is_not_read_staged(
        make_tier: Any, shared_client: None, monkeypatch: pytest.MonkeyPatch,
        code: int) -> None:
    """Read the staged way only where a get session answers it (before any
    transfer); from the batch call it is a failure like any other."""
    tier = make_tier()
    assert put(tier, [1, 2]) == 2
    assert torch.equal(read(tier, 1), chunk(1))
    errors = tier.stats()["errors"]
    store = failing(tier, monkeypatch, hide=SESSIONS,
                    batch_get_into_multi_buffers=lambda codes: [code] * len(codes))
    assert read(tier, 2) is None
    assert store.calls == [BATCH]
    assert tier.stats()["errors"] == errors + 1
