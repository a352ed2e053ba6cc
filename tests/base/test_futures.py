"""Futures finished when made behave as any finished ``concurrent.futures.Future``."""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError, as_completed, wait

import pytest

from lmkv.base.futures import Finished
from lmkv.contracts.tier import done_future


def test_a_finished_future_answers_as_a_finished_one() -> None:
    made = done_future([1, 2])
    assert isinstance(made, Finished) and isinstance(made, Future)
    assert made.result(0) == [1, 2] and made.exception(0) is None
    assert made.done() and not made.running() and not made.cancelled()
    assert made.cancel() is False and not made.cancelled()
    with pytest.raises(InvalidStateError):
        made.set_result(3)
    with pytest.raises(InvalidStateError):
        made.set_exception(ValueError("late"))
    assert made.result() == [1, 2]
    seen: list = []
    made.add_done_callback(lambda f: seen.append(f.result()))  # called at once
    assert seen == [[1, 2]]


def test_finished_futures_mix_with_pending_ones_in_wait_and_as_completed() -> None:
    pending: Future = Future()
    timer = threading.Timer(0.05, pending.set_result, (3,))
    timer.start()
    try:
        done, not_done = wait([Finished(1), Finished(2), pending], timeout=5)
        assert not not_done and sorted(f.result() for f in done) == [1, 2, 3]
        assert sorted(f.result() for f in as_completed([Finished(4), pending], 5)) == [3, 4]
    finally:
        timer.cancel()


def test_threads_waiting_on_overlapping_sets_never_block_each_other() -> None:
    """Each finished future has its own lock: ``wait`` takes every future's lock at
    once, and one shared lock would order them against pending ones badly."""
    pendings = [Future() for _ in range(4)]
    finished = [Finished(i) for i in range(4)]
    errors: list[BaseException] = []

    def waiter(fs: list[Future]) -> None:
        try:
            for _ in range(200):
                wait(fs, timeout=0)
        except BaseException as exc:  # pragma: no cover (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=([*finished, *pendings][::step],))
               for step in (1, -1, 2, -2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and not errors
