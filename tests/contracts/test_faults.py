"""The one fault policy every tier shares (lmkv.contracts.faults), on a fake clock."""

from __future__ import annotations

import logging

import pytest

import lmkv.contracts.faults
from lmkv.contracts.faults import Breaker, BreakerOpen, TierCounters, TierFaults, TierUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(lmkv.contracts.faults.time, "monotonic", clock)
    return clock


def test_the_breaker_opens_probes_once_per_interval_and_closes(clock: Clock) -> None:
    breaker = Breaker(first_backoff_s=1.0, longest_backoff_s=4.0)
    breaker.check()  # closed: no error
    breaker.failed(OSError("down"))
    assert breaker.is_open
    with pytest.raises(BreakerOpen, match="down"):
        breaker.check()
    clock.now += 1.5
    breaker.check()  # the probe goes through ...
    with pytest.raises(BreakerOpen):
        breaker.check()  # ... and nobody else meanwhile
    breaker.failed(OSError("still down"))  # the probe failed: a longer interval
    clock.now += 1.5
    with pytest.raises(BreakerOpen):
        breaker.check()
    clock.now += 1.0
    breaker.check()
    breaker.succeeded()
    assert not breaker.is_open
    breaker.check()
    breaker.check()


def test_the_interval_grows_to_its_longest(clock: Clock) -> None:
    breaker = Breaker(first_backoff_s=1.0, longest_backoff_s=2.0)
    for _ in range(5):
        breaker.failed(OSError())
    clock.now += 2.01
    breaker.check()


def test_a_breaker_without_backoff_never_opens() -> None:
    breaker = Breaker(first_backoff_s=0.0)
    breaker.failed(OSError())
    assert not breaker.is_open
    breaker.check()


def make_faults() -> TierFaults:
    return TierFaults(TierCounters(), "test tier", absorbed=(OSError,),
                      unreachable=(ConnectionError,), breaker=Breaker(10.0, 10.0),
                      redact=lambda exc: str(exc).replace("hunter2", "***"))


def test_an_unreachable_fault_opens_the_breaker_and_counts_once(
        clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    faults = make_faults()
    with caplog.at_level(logging.WARNING), faults.guard("get", "a miss"):
        raise ConnectionRefusedError("password hunter2 refused")
    assert faults.counters.errors == 1 and faults.breaker.is_open
    assert "hunter2" not in caplog.text and "get failed" in caplog.text
    with faults.guard("get", "a miss"):
        faults.check()  # refused, not attempted: not an error
    assert faults.counters.errors == 1


def test_a_fault_of_one_operation_leaves_the_breaker_closed() -> None:
    faults = make_faults()
    with faults.guard("read", "a miss"):
        raise PermissionError("no")
    assert faults.counters.errors == 1 and not faults.breaker.is_open


def test_what_the_tier_does_not_absorb_raises() -> None:
    faults = make_faults()
    with pytest.raises(KeyError), faults.guard("get", "a miss"):
        raise KeyError("a bug")
    assert faults.counters.errors == 0


def test_a_tier_unavailable_is_always_a_fault() -> None:
    faults = TierFaults(TierCounters(), "t", absorbed=(), unreachable=(TierUnavailable,),
                        breaker=Breaker(10.0))
    with faults.guard("put", "dropped"):
        raise TierUnavailable("gone")
    assert faults.counters.errors == 1 and faults.breaker.is_open


def test_after_close_everything_is_absorbed_and_nothing_counted() -> None:
    faults = make_faults()
    faults.close()
    with faults.guard("get", "a miss"):
        raise ValueError("a socket pulled from under a call")
    assert faults.counters.errors == 0


def test_a_corrupt_entry_is_counted() -> None:
    faults = make_faults()
    faults.corrupt("key", "checksum")
    assert faults.counters.corrupt_frames == 1 and faults.counters.errors == 0


def test_the_last_resort_counts_a_fault_and_logs_a_bug_loudly_uncounted(
        caplog: pytest.LogCaptureFixture) -> None:
    faults = make_faults()
    with caplog.at_level(logging.WARNING):
        faults.last_resort("get", PermissionError("denied"), "a miss")
        assert faults.counters.errors == 1
        try:
            raise TypeError("a bug")
        except TypeError as exc:
            faults.last_resort("get", exc, "a miss")
    assert faults.counters.errors == 1
    (bug,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "a bug in the tier" in bug.getMessage()
    assert "Traceback" in bug.getMessage() and "TypeError: a bug" in bug.getMessage()


def test_the_default_absorbs_io_errors_only() -> None:
    faults = TierFaults(TierCounters(), "t")
    with faults.guard("get", "a miss"):
        raise OSError("disk")
    with pytest.raises(TypeError), faults.guard("get", "a miss"):
        raise TypeError("a bug")
    assert faults.counters.errors == 1
