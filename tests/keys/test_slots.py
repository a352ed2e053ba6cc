"""``SlotKeys``: keys numbered by dense slots, held as their hashes."""

from __future__ import annotations

import random

import pytest

from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.keys.slots import PySlotKeys, SlotKeys


def test_each_key_has_its_own_slot_and_comes_back_equal() -> None:
    slots = SlotKeys()
    a, b = KeyMeta("a"), KeyMeta("b", geometry="2x2x64")
    keys = [CacheKey(a, bytes([i]) * 32) for i in range(4)]
    keys += [CacheKey(b, bytes(32)), CacheKey(a, bytes(32), layer=3),  # same hash, other key
             CacheKey(a, b"short"), CacheKey(a, bytes(31)), CacheKey(a, bytes(33))]
    numbers = [slots.add(k) for k in keys]
    assert numbers == list(range(len(keys))) and len(slots) == len(keys)
    assert [slots.add(k) for k in keys] == numbers  # a key keeps its slot
    for number, key in zip(numbers, keys, strict=True):
        assert slots.slot(key) == number
        assert slots.key(number) == key
        # an equal key made apart (another meta object) finds the same slot
        twin = CacheKey(KeyMeta(**{f: getattr(key.meta, f) for f in key.meta.__struct_fields__}),
                        bytes(key.chunk_hash), key.layer)
        assert slots.slot(twin) == number
    assert slots.slot(CacheKey(KeyMeta("c"), bytes(32))) is None
    assert slots.slot(CacheKey(a, bytes([9]) * 32)) is None


def test_a_slot_given_back_is_reused_and_names_the_new_key_only() -> None:
    slots = SlotKeys()
    meta = KeyMeta("m")
    first, second = CacheKey(meta, bytes([1]) * 32), CacheKey(meta, bytes([2]) * 32)
    number = slots.add(first)
    slots.remove(number)
    slots.remove(number)  # twice: nothing more
    assert slots.slot(first) is None and len(slots) == 0
    with pytest.raises(KeyError, match="free"):
        slots.key(number)
    assert slots.add(second) == number and slots.capacity == 1
    assert slots.slot(first) is None and slots.key(number) == second
    assert slots.slots() == [number]


def test_a_model_whose_keys_all_left_costs_nothing_after() -> None:
    """Keys of ever new models (a client naming any model it likes) come and go:
    the per-model tables go with their last key, and their numbers are reused."""
    slots = SlotKeys()
    for i in range(1000):
        key = CacheKey(KeyMeta(f"model-{i}"), bytes([i % 256]) * 32)
        number = slots.add(key)
        assert slots.key(number) == key
        slots.remove(number)
        assert slots.slot(key) is None
    assert len(slots._spaces) == 1 and not slots._space_ids and len(slots) == 0
    kept = CacheKey(KeyMeta("kept"), bytes(32))
    assert slots.key(slots.add(kept)) == kept


def test_a_name_stands_for_its_key_after_the_slot_goes_to_another() -> None:
    """``name``: what a policy remembers a key that left by. Equal keys, equal
    names; the key a slot held keeps its name once the slot holds another."""
    slots = SlotKeys()
    meta = KeyMeta("a")
    first, second = CacheKey(meta, bytes([1]) * 32), CacheKey(meta, bytes([2]) * 32)
    layered = CacheKey(meta, bytes([1]) * 32, layer=3)  # the same hash, another key
    short = CacheKey(meta, b"short")
    slot = slots.add(first)
    named = slots.name(slot)
    assert slots.name(slots.add(layered)) != named
    assert slots.name(slots.add(short)) not in (named, slots.name(slots.slot(layered)))
    slots.remove(slot)
    with pytest.raises(KeyError):
        slots.name(slot)
    assert slots.add(second) == slot  # the slot given back goes to another key
    assert slots.name(slot) != named
    slots.remove(slot)
    again = slots.add(first)
    assert slots.name(again) == named  # the key back: its name again
    hash(named)


def test_a_name_does_not_follow_a_space_number_to_another_model() -> None:
    """Spaces that empty give their numbers back; a model back under another
    number keeps its keys' names, and a model taking a freed number takes none."""
    slots = SlotKeys()
    a, b = KeyMeta("a"), KeyMeta("b")
    digest = bytes([7]) * 32
    first_a, first_b = slots.add(CacheKey(a, digest)), slots.add(CacheKey(b, digest))
    named_a, named_b = slots.name(first_a), slots.name(first_b)
    first_b_space = slots.space_number(first_b)
    assert named_a != named_b
    slots.remove(first_b)
    slots.remove(first_a)  # both spaces empty: their numbers are free, a's handed first
    again_b, again_a = slots.add(CacheKey(b, digest)), slots.add(CacheKey(a, digest))
    assert slots.space_number(again_b) != first_b_space  # b has a's old number
    assert (slots.name(again_a), slots.name(again_b)) == (named_a, named_b)
    layered = slots.add(CacheKey(a, digest, layer=5))
    assert slots.name(layered) not in (named_a, named_b)


@pytest.mark.skipif(SlotKeys is PySlotKeys, reason="the C accelerator is not built here")
def test_the_c_slot_keys_answer_as_the_python_ones_op_for_op() -> None:
    """Random adds, lookups and removes of keys over several models and layers
    (hashes of 32 bytes and of other lengths, equal metas made apart) on both:
    the same slots, keys, names and sizes after every step."""
    rng = random.Random(11)
    metas = [KeyMeta(f"m{i % 3}", geometry="" if i < 3 else "2x2x64") for i in range(5)]
    pool = [CacheKey(rng.choice(metas), rng.randbytes(rng.choice((32, 32, 32, 8, 33))),
                     rng.choice((-1, -1, 0, 7))) for _ in range(600)]
    c, py = SlotKeys(), PySlotKeys()
    for step in range(20000):
        roll = rng.random()
        if roll < 0.45:
            key = rng.choice(pool)
            if rng.random() < 0.2:  # an equal key made apart
                key = CacheKey(KeyMeta(**{f: getattr(key.meta, f)
                                          for f in key.meta.__struct_fields__}),
                               bytes(key.chunk_hash), key.layer)
            assert c.add(key) == py.add(key)
        elif roll < 0.75:
            key = rng.choice(pool)
            assert c.slot(key) == py.slot(key)
            assert c.slot_named(key, False) == py.slot_named(key, False)
        elif py.capacity:
            slot = rng.randrange(py.capacity)
            assert c.slot_named(slot, True) == py.slot_named(slot, True)
            if rng.random() < 0.5:
                c.remove(slot)
                py.remove(slot)
            elif slot in py.slots():
                assert c.key(slot) == py.key(slot)
                assert c.name(slot) == py.name(slot)
                assert c.space_number(slot) == py.space_number(slot)
            else:
                with pytest.raises(KeyError):
                    c.key(slot)
        assert len(c) == len(py) and c.capacity == py.capacity
        if step % 500 == 0:
            assert c.slots() == py.slots()
            assert c.add_many(pool[:50]) == py.add_many(pool[:50])
    for slot in py.slots():
        c.remove(slot)
        py.remove(slot)
    assert len(c) == 0 and not c._space_ids and all(s is None for s in c._spaces)


@pytest.mark.parametrize("kind", [PySlotKeys, SlotKeys], ids=["python", "default"])
def test_odd_digests_and_bad_slots(kind: type) -> None:
    """A chunk hash of a bytes subclass is the same key as its bytes; a digest whose
    ``__eq__`` changes the index while it is compared leaves it right; a slot out of
    range is an IndexError, never another slot."""
    slots = kind()
    meta = KeyMeta("odd")

    class Bytes(bytes):
        pass

    digest = bytes([3]) * 32
    number = slots.add(CacheKey(meta, digest))
    assert slots.slot(CacheKey(meta, Bytes(digest))) == number
    assert slots.add(CacheKey(meta, Bytes(digest))) == number

    class Meddling:
        """Compared with a key of equal hash, it stores many keys first."""

        def __init__(self, value: int) -> None:
            self.value = value

        def __hash__(self) -> int:
            return 12345

        def __len__(self) -> int:
            return 8

        def __eq__(self, other: object) -> bool:
            for i in range(300):
                slots.add(CacheKey(meta, bytes([i % 256, i // 256]) * 16))
            return isinstance(other, Meddling) and other.value == self.value

    first = slots.add(CacheKey(meta, Meddling(1)))  # type: ignore[arg-type]
    second = slots.add(CacheKey(meta, Meddling(2)))  # type: ignore[arg-type]
    assert first != second
    assert slots.slot(CacheKey(meta, Meddling(1))) == first  # type: ignore[arg-type]
    assert slots.slot(CacheKey(meta, Meddling(2))) == second  # type: ignore[arg-type]
    for bad in (-1, slots.capacity, 2**40):
        with pytest.raises(IndexError):
            slots.key(bad)
        with pytest.raises(IndexError):
            slots.remove(bad)
    assert slots.slot(CacheKey(meta, digest)) == number


@pytest.mark.skipif(SlotKeys is PySlotKeys, reason="the C accelerator is not built here")
def test_an_index_made_without_init_says_so() -> None:
    from lmkv._ext import _slots

    bare = _slots.SlotKeys.__new__(_slots.SlotKeys)
    with pytest.raises(RuntimeError, match="__init__"):
        bare.slot(CacheKey(KeyMeta("m"), bytes(32)))
    with pytest.raises(RuntimeError, match="__init__"):
        bare.add(CacheKey(KeyMeta("m"), bytes(32)))
    assert len(bare) == 0
