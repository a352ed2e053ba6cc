"""The cpu tier's compact index: keys by slot, entries as offsets in arrays, the
lru order in arrays. It must behave exactly as a tier that keeps everything
per key, and cost a few hundred bytes per entry, not a kilobyte."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

from lmkv.contracts.policy import EvictionPolicy
from lmkv.contracts.tier import BackendContext
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv_backends.tiers import cpu as cpu_module
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.arc import ARCPolicy
from lmkv_policies.lfu import LFUPolicy
from lmkv_policies.lru import LRUPolicy
from lmkv_policies.s3fifo import S3FIFOPolicy

SHAPE = (4, 16)  # 128 bytes of float16: a tiny chunk
META = KeyMeta("m")


class KeyedLRU(LRUPolicy):
    """``lru`` handed keys, not slots: the order a policy without slots is kept in."""

    orders_slots = False


def keyed(policy: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """``policy`` handed keys, not slots."""
    return type(f"Keyed{policy.__name__}", (policy,), {"orders_slots": False})


# Every built-in policy that orders slots, with its twin handed keys. lfu, arc and
# s3fifo remember keys that left (ghosts): the random walks below store evicted
# keys again, into slots other keys held meanwhile.
SLOT_POLICIES = [(LRUPolicy, KeyedLRU)] + [(p, keyed(p))
                                           for p in (LFUPolicy, ARCPolicy, S3FIFOPolicy)]


def tier(policy: type[EvictionPolicy] = LRUPolicy, chunks: int = 64) -> CPUBackend:
    return CPUBackend(CPUBackend.Options(max_bytes=chunks * 256, prefault_ahead=0),
                      BackendContext(eviction_policy=policy()))


def key(i: int) -> CacheKey:
    return CacheKey(META, i.to_bytes(32, "little"))


def store(backend: CPUBackend, ids: list[int], parents: list[int | None]) -> int:
    objs = []
    for i in ids:
        obj = backend.allocate(SHAPE, torch.float16)
        if obj is None:
            break
        obj.tensor.fill_(i % 2000)
        objs.append(obj)
    stored = backend.batched_submit_put(
        [key(i) for i in ids[:len(objs)]], objs,
        [None if p is None else key(p) for p in parents[:len(objs)]]).result()
    for obj in objs:
        obj.ref_down()
    return stored


def contents(backend: CPUBackend) -> set[int]:
    out = set()
    for slot in backend._stored_slots():
        out.add(int.from_bytes(backend._keys.key(slot).chunk_hash, "little"))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policies", SLOT_POLICIES, ids=lambda p: p[0].name)
def test_the_slot_index_evicts_exactly_what_the_keyed_one_does(
        seed: int, policies: tuple[type[EvictionPolicy], type[EvictionPolicy]]) -> None:
    """Prompts stored head first and tail first, read, removed and pinned, in a tier
    too small for them: after each step both tiers hold the same chunks, and each
    chunk read back holds its own bytes. A policy ordering slots decides as it
    does handed keys, what it remembers of keys that left included."""
    rng = random.Random(seed)
    slots, keyed = tier(policies[0]), tier(policies[1])
    assert slots._by_slot and not keyed._by_slot
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            start, length = rng.randrange(0, 400, 8), rng.randrange(1, 9)
            ids = list(range(start, start + length))
            parents = [None if i == start else i - 1 for i in ids]
            if rng.random() < 0.25:  # the tail first (a promotion before its head)
                ids.reverse()
                parents.reverse()
            assert store(slots, ids, parents) == store(keyed, ids, parents)
        elif op < 0.8:
            ids = sorted(contents(keyed))
            if not ids:
                continue
            first = rng.choice(ids)
            wanted = [key(first + n) for n in range(rng.randrange(1, 5))]
            got = [t.batched_get_non_blocking("r", wanted).result() for t in (slots, keyed)]
            assert len(got[0]) == len(got[1])
            for obj_a, obj_b, k in zip(*got, wanted, strict=False):
                value = int.from_bytes(k.chunk_hash, "little") % 2000
                assert torch.all(obj_a.tensor == value) and torch.all(obj_b.tensor == value)
                obj_a.ref_down()
                obj_b.ref_down()
        elif op < 0.9:
            ids = sorted(contents(keyed))
            if ids:
                victim = key(rng.choice(ids))
                assert slots.remove(victim) == keyed.remove(victim)
        else:
            ids = sorted(contents(keyed))
            if ids:
                pinned = key(rng.choice(ids))
                assert slots.pin(pinned) and keyed.pin(pinned)
                store(slots, [9000, 9001], [None, 9000])  # pressure while pinned
                store(keyed, [9000, 9001], [None, 9000])
                assert slots.contains(pinned) and keyed.contains(pinned)
                assert slots.unpin(pinned) and keyed.unpin(pinned)
        assert contents(slots) == contents(keyed)
        assert slots.usage_bytes == keyed.usage_bytes and len(slots) == len(keyed)
    assert slots.eviction_candidates() == keyed.eviction_candidates()
    slots.clear()
    keyed.clear()
    assert slots.allocator.used_bytes == keyed.allocator.used_bytes == 0
    # Nothing stored: every slot given back, the parents' included.
    assert len(slots._keys) == 0


def test_a_slot_given_back_takes_nothing_of_its_last_key() -> None:
    backend = tier()
    store(backend, [1, 2], [None, 1])
    assert backend.pin(key(2))
    with pytest.raises(AssertionError):
        assert backend.remove(key(2))  # pinned: stays
    assert backend.unpin(key(2)) and backend.remove(key(2)) and backend.remove(key(1))
    assert len(backend._keys) == 0
    store(backend, [3], [None])  # takes a slot given back
    assert not backend.contains(key(1)) and not backend.contains(key(2))
    assert backend.entry_refs() == [(1, 0)]
    (obj,) = backend.batched_get_non_blocking("r", [key(3)]).result()
    assert torch.all(obj.tensor == 3)
    obj.ref_down()


def test_a_reader_keeps_its_buffer_after_the_tier_drops_the_entry() -> None:
    backend = tier()
    store(backend, [5], [None])
    (obj,) = backend.batched_get_non_blocking("r", [key(5)]).result()
    assert backend.remove(key(5)) and not backend.contains(key(5))
    assert backend.allocator.used_bytes > 0 and torch.all(obj.tensor == 5)
    obj.ref_down()
    assert backend.allocator.used_bytes == 0


def test_entries_only_the_tier_holds_keep_no_memory_obj(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(cpu_module, "_SWEEP_MIN", 16)
    backend = tier(chunks=512)
    for start in range(0, 400, 8):
        store(backend, list(range(start, start + 8)), [None, *list(range(start, start + 7))])
    assert len(backend) == 400 and len(backend._live) <= 2 * 16
    got = backend.batched_get_non_blocking("r", [key(i) for i in range(8)]).result()
    assert all(obj.ref_count == 2 for obj in got)  # held by the tier and the reader
    store(backend, [1000], [None])  # a sweep: what the reader holds stays
    assert all(backend._live.get(backend._keys.slot(key(i))) is got[i] for i in range(8))
    for obj in got:
        obj.ref_down()
    assert all(refs == (1, 0) for refs in backend.entry_refs())


def test_an_entry_costs_the_python_heap_a_few_hundred_bytes() -> None:
    """What the index keeps per entry on the Python heap (tracemalloc: the key's
    hash, a dict slot, its slot number, the arrays), keys made and dropped per
    batch as the storage manager does. A tensor per entry is not on this heap
    (torch allocates it), and ``test_a_buffer_of_the_arena_keeps_no_tensor...``
    checks there is none; a MemoryObj or a CacheKey kept per entry would show."""
    n = 20_000
    backend = tier(chunks=n + 64)
    store(backend, [0], [None])  # first-use costs
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(1, n + 1, 256):
            ids = list(range(start, min(start + 256, n + 1)))
            store(backend, ids, [start - 1, *ids[:-1]])
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(backend) == n + 1
    assert per_entry < 220, f"{per_entry:.0f} bytes per entry"


def test_a_copied_in_chunk_whose_room_evicts_its_own_extension() -> None:
    """A chunk from outside the arena (copied in) whose room is made by evicting the
    one stored chunk that extends it: the slot its key had only as that chunk's
    parent is given back while room is made, and the chunk still lands under its
    own key, with its own bytes."""
    from lmkv.memory import tensor_obj

    backend = tier(chunks=16)
    assert store(backend, [8], [7]) == 1  # 7 has a slot only as 8's parent
    assert store(backend, list(range(100, 115)), [None] * 15) == 15  # full; 8 the oldest
    parent_slot = backend._keys.slot(key(7))
    assert parent_slot is not None and backend._offset[parent_slot] < 0
    chunk = tensor_obj(torch.full(SHAPE, 7, dtype=torch.float16))
    assert backend.batched_submit_put([key(7)], [chunk]).result() == 1
    assert not backend.contains(key(8)) and backend.contains(key(7))
    (obj,) = backend.batched_get_non_blocking("r", [key(7)]).result()
    assert torch.all(obj.tensor == 7)
    obj.ref_down()
    assert len(backend._keys) == 16 and backend.entry_refs() == [(1, 0)] * 16


@pytest.mark.parametrize("policy", [LRUPolicy, KeyedLRU])
def test_a_chain_copied_in_while_making_room_keeps_its_lineage(policy: type[LRUPolicy]
                                                              ) -> None:
    """Chunks from outside the arena, a chain in one put, into a full tier: making
    room for the second evicts the first (given its slot back). The second must
    not be named the child of whatever takes that slot next: the chain stays
    evictable tail first, as under a policy handed keys."""
    from lmkv.memory import tensor_obj

    backend = tier(policy, chunks=16)
    assert store(backend, [9], [None]) == 1 and backend.pin(key(9))
    held = [backend.allocate(SHAPE, torch.float16) for _ in range(14)]  # all but one
    outside = [tensor_obj(torch.full(SHAPE, v, dtype=torch.float16)) for v in (1, 2)]
    chain = [key(1), key(2)]  # the parents are these objects, as a chunker makes them
    assert backend.batched_submit_put(chain, outside, [key(100), chain[0]]).result() == 2
    assert not backend.contains(key(1)) and backend.contains(key(2))  # 1 made room for 2
    tail = held.pop()
    tail.tensor.fill_(3)
    assert backend.batched_submit_put([key(3)], [tail], [key(2)]).result() == 1
    tail.ref_down()
    for obj in held:
        obj.ref_down()
    assert backend.unpin(key(9))
    assert backend.eviction_candidates() == [key(9), key(3)]
    # Room for the whole arena: every entry goes, the chain tail first.
    whole = backend.allocate((16, 8, 16), torch.float16)  # 4096 bytes: the arena
    assert whole is not None and len(backend) == 0
    whole.ref_down()


@pytest.mark.parametrize("policy", [LRUPolicy, KeyedLRU])
def test_a_full_arena_hands_the_victims_bytes_to_the_new_buffer(policy) -> None:
    backend = tier(policy, chunks=16)
    assert store(backend, list(range(16)), [None] * 16) == 16
    alloc = backend.allocator
    used, live = alloc.used_bytes, alloc.live_objects
    first = backend._offset[backend._keys.slot(key(0))] * backend._align
    held = backend.get_blocking(key(1))  # held by a reader: never a victim
    assert backend.pin(key(2))  # pinned: never a victim
    obj = backend.allocate(SHAPE, torch.float16)  # full: evicts key 0, takes its bytes
    assert obj is not None and obj.offset == first
    assert not backend.contains(key(0)) and backend.counters.evictions == 1
    assert (alloc.used_bytes, alloc.live_objects) == (used, live)  # handed over, not freed
    again = backend.allocate(SHAPE, torch.float16)  # next victim: key 3 (1 held, 2 pinned)
    assert again is not None
    assert not backend.contains(key(3))
    assert backend.contains(key(1)) and backend.contains(key(2))
    for got in (obj, again, held):
        got.ref_down()
    assert alloc.used_bytes == used - 2 * obj.nbytes  # the new buffers freed as any
    assert backend.unpin(key(2))
    assert store(backend, [100, 101, 102], [None] * 3) == 3  # the arena serves on
    backend.close()


def test_a_victim_of_another_size_is_evicted_the_general_way() -> None:
    backend = tier(chunks=16)
    assert store(backend, list(range(16)), [None] * 16) == 16
    obj = backend.allocate((16, 16), torch.float16)  # two chunks' bytes (256 each, aligned)
    assert obj is not None and backend.counters.evictions == 2
    assert not backend.contains(key(0)) and not backend.contains(key(1))
    obj.ref_down()
    backend.close()


@pytest.mark.skipif(cpu_module._record_puts is cpu_module._record_puts_py,
                    reason="the C accelerator is not built here")
def test_the_c_batch_record_is_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_puts`` (a batch of the tier's own buffers) in C and its Python twin,
    on random batches: slots stored already, a key twice, parents that are the
    chunk before, roots and others left to resolve, layouts interned and not: the
    same arrays, dicts and outputs."""
    from array import array

    import lmkv.memory
    from lmkv.memory import Layout, MemoryAllocator

    monkeypatch.setattr(lmkv.memory, "strict_refcounts", False)  # released: logged, skipped
    rng = random.Random(5)
    alloc = MemoryAllocator(1 << 20, pin_memory=False)
    interned = alloc.layout((4, 8), torch.float16)
    odd_layout = Layout(-1, torch.float16, torch.Size((3,)), 6, 256)
    for wide in ("i", "q"):
        states = [(array(wide, [-1] * 64), array("h", [-1] * 64), {}, {}) for _ in range(2)]
        for _ in range(200):
            n = rng.randint(0, 8)
            keys = [key(rng.randrange(40)) for _ in range(n)]
            objs = [alloc.reuse(256 * rng.randrange(1000),
                                odd_layout if rng.random() < 0.2 else interned)
                    for _ in range(n)]
            slots = [rng.randrange(64) for _ in range(n)]
            parents = [rng.choice([None, keys[i - 1] if i else None, key(99)])
                       for i in range(n)]
            outs = []
            if rng.random() < 0.1 and objs:  # a released buffer is never recorded
                objs[0].ref_count = 0
            for record, (offsets, idents, odd, live) in zip(
                    (cpu_module._record_puts, cpu_module._record_puts_py), states, strict=True):
                out: list = [[], [], [], [0]]
                record(keys, objs, slots, parents, offsets, idents, odd, live, 256, out)
                outs.append(out)
            assert outs[0] == outs[1]
            # each buffer recorded took a reference in each, the tier's
            assert sum(o.ref_count - 1 for o in objs if o.ref_count) == 2 * len(outs[0][0])
            assert states[0][0] == states[1][0] and states[0][1] == states[1][1]
            assert states[0][2] == states[1][2] and states[0][3] == states[1][3]
            if rng.random() < 0.3:  # entries leave
                for offsets, idents, odd, live in states:
                    for slot in range(0, 64, 3):
                        offsets[slot] = idents[slot] = -1
                        odd.pop(slot, None)
                        live.pop(slot, None)
    with pytest.raises(TypeError):
        cpu_module._record_puts([key(1)], ["not a buffer"], [0], [None], array("i", [-1]),
                                array("h", [-1]), {}, {}, 256, [[], [], [], [0]])
    with pytest.raises(IndexError):
        cpu_module._record_puts([key(1)], [alloc.reuse(0, interned)], [5], [None],
                                array("i", [-1]), array("h", [-1]), {}, {}, 256,
                                [[], [], [], [0]])


def test_a_batch_with_a_bad_key_leaves_no_slot_behind() -> None:
    """A key that cannot be numbered (not a CacheKey) fails the batch: the slots the
    keys before it were given go back, and the buffers stay the caller's."""
    backend = tier()
    objs = [backend.allocate(SHAPE, torch.float16) for _ in range(3)]
    with pytest.raises((AttributeError, TypeError)):
        backend.batched_submit_put([key(1), key(2), "not a key"], objs)  # type: ignore[list-item]
    assert len(backend._keys) == 0 and len(backend) == 0
    assert all(obj.ref_count == 1 for obj in objs)
    assert store(backend, [1, 2], [None, 1]) == 2  # and the tier goes on
    for obj in objs:
        obj.ref_down()
    assert len(backend) == 2
