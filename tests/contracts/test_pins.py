"""``lmkv.contracts.pins.PinTable``: a remote tier's local pins (the redis and
mooncake tiers run it against real servers in their own suites)."""

from __future__ import annotations

import threading

import pytest

from lmkv.contracts import PinTable


def test_pins_count_and_unpins_give_back_one_at_a_time() -> None:
    pins: PinTable[int] = PinTable()
    pins.pin(["a", "b"])
    pins.pin(["a"])
    assert (pins.count("a"), pins.count("b"), len(pins)) == (2, 1, 2)
    assert pins.unpin("a") and pins.count("a") == 1
    assert pins.unpin("a") and pins.count("a") == 0
    assert not pins.unpin("a"), "no pin left: unpin says so"
    assert not pins.unpin("never")
    assert len(pins) == 1
    pins.clear()
    assert len(pins) == 0 and not pins.unpin("b")


def test_what_the_latest_lookup_saw_is_kept_while_pinned() -> None:
    pins: PinTable[int] = PinTable()
    assert pins.seen("a", 1) == 1
    pins.pin(["a", "b"], [3, 5])
    pins.pin(["a"])  # a pin that saw nothing keeps what was seen
    assert (pins.seen("a", 1), pins.seen("b", 1)) == (3, 5)
    pins.pin(["a"], [4])  # the latest lookup's part count wins
    assert pins.seen("a", 1) == 4
    for _ in range(3):
        pins.unpin("a")
    assert pins.seen("a", 1) == 1, "unpinned: nothing is known any more"
    with pytest.raises(ValueError, match="2 names but 1 seen"):
        pins.pin(["x", "y"], [1])


def test_pins_from_many_threads_add_up() -> None:
    pins: PinTable[None] = PinTable()
    names = [f"k{i}" for i in range(50)]

    def work() -> None:
        for _ in range(200):
            pins.pin(names)
            for name in names:
                assert pins.unpin(name)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(pins) == 0
