"""The eviction-policy conformance suite.

Subclass ``EvictionPolicyConformance`` in a class whose name starts with
``Test`` and name your policy class (and the options a config would give it);
every test below then runs against your policy, built the way lmkv builds it
(``cls(options, EvictionContext(...))``), alone and inside a real ``cpu``
tier::

    class TestMyPolicy(EvictionPolicyConformance):
        policy_class = MyPolicy

        def policy_options(self):
            return {"decay_period": 50}

What it checks: the class passes lmkv's load check (its contract version, no
abstract method left, its constructor and hooks callable the way lmkv calls
them, the final methods left alone); then, all through the methods a tier
calls (``insert``, ``access``, ``forget``, ``candidates``): ``victims``
yields stored keys only, each once, and every leaf on a full pass; removing
everything leaves nothing to evict; memory does not grow with the number of
keys that went through the policy, only with what is stored (ghost lists
bounded by the entries stored are fine); a policy that orders slots
(``orders_slots``) orders them as it orders keys; through a small cpu tier fed random
prompt trees, every stored chunk's parent stays stored (no orphaned prefix:
each stored prompt is contiguous from its first chunk), pinned and referenced
entries are never evicted, and usage is back to zero once everything is
removed.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Hashable
from typing import Any

import pytest
import torch

from lmkv.contracts.policy import EvictionContext, EvictionPolicy
from lmkv.contracts.tier import BackendContext, StorageBackend
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.testing.building import build_plugin, load_problem


class EvictionPolicyConformance:
    """Contract tests every eviction policy passes."""

    chunk_shape: tuple[int, ...] = (2, 2, 16, 2, 32)
    dtype: torch.dtype = torch.float16
    meta = KeyMeta("policy-conformance", 1, 0, "float16", "l2thd")
    #: Entries the small tier of the tier tests holds.
    tier_entries: int = 12
    #: Random operations per randomized test (kept small: the suite runs in seconds).
    operations: int = 1500
    seed: int = 11

    #: The policy class under test.
    policy_class: type[EvictionPolicy] | None = None

    def policy_options(self) -> dict[str, Any]:
        """The ``options`` a config would give the policy."""
        return {}

    def make_policy(self) -> EvictionPolicy:
        """A fresh policy, built the way lmkv builds the one a tier's config names."""
        if self.policy_class is None:
            pytest.fail("set policy_class (and policy_options) on the kit's subclass: "
                        "the kit builds and checks the policy the way lmkv does")
        return build_plugin(self.policy_class, self.policy_options(),
                            EvictionContext(tier_index=0))

    # -- helpers -----------------------------------------------------------------
    def key(self, i: int) -> CacheKey:
        return CacheKey(self.meta, i.to_bytes(32, "little"))

    @property
    def chunk_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return torch.Size(self.chunk_shape).numel() * itemsize

    def make_tier(self, entries: int) -> StorageBackend:
        from lmkv.plugins.manager import get_plugin_manager

        cpu = get_plugin_manager().storage_backend("cpu")
        return cpu({"max_bytes": max(4096, entries * self.chunk_bytes)},
                   BackendContext(eviction_policy=self.make_policy()))

    def _prompts(self, rng: random.Random, n: int) -> list[list[int]]:
        """``n`` prompts as chunk ids, drawn from a random tree of shared prefixes:
        each new prompt extends a random prefix of an earlier one (or none)."""
        prompts: list[list[int]] = []
        next_id = 0
        for _ in range(n):
            if prompts and rng.random() < 0.8:
                base = rng.choice(prompts)
                head = base[:rng.randint(0, len(base))]
            else:
                head = []
            tail = list(range(next_id, next_id + rng.randint(1, 6)))
            next_id += len(tail)
            prompts.append(head + tail)
        return prompts

    def _request(self, tier: StorageBackend, ids: list[int]) -> None:
        """What an engine does for one request: read the stored prefix (refreshing
        it; the buffers read are held until the rest is stored, as while the
        request computes), then store the rest with its parents."""
        keys = [self.key(i) for i in ids]
        got = tier.batched_get_non_blocking("conformance", keys).result()
        hits = len(got)
        objs, stored_keys, parents = [], [], []
        for i in range(hits, len(keys)):
            obj = tier.allocate(self.chunk_shape, self.dtype)
            if obj is None:
                break
            obj.tensor.fill_(ids[i] % 100)
            objs.append(obj)
            stored_keys.append(keys[i])
            parents.append(keys[i - 1] if i else None)
        if objs:
            tier.batched_submit_put(stored_keys, objs, parents).result()
        for obj in [*got, *objs]:
            obj.ref_down()

    def _stored(self, tier: StorageBackend, ids: list[int]) -> list[bool]:
        return [tier.contains(self.key(i)) for i in ids]

    # -- the policy alone ----------------------------------------------------------
    def _random_walk(self, policy: EvictionPolicy, steps: int, check: bool) -> None:
        rng = random.Random(self.seed)
        stored: dict[Hashable, Hashable | None] = {}
        chains: list[list[int]] = []
        next_id = 0
        for step in range(steps):
            roll = rng.random()
            if roll < 0.45 or not stored:
                if chains and rng.random() < 0.7:
                    chain = rng.choice(chains)
                    parent = self.key(chain[-1]) if self.key(chain[-1]) in stored else None
                else:
                    chain, parent = [], None
                    chains.append(chain)
                chain.append(next_id)
                key = self.key(next_id)
                next_id += 1
                policy.insert(key, parent)
                stored[key] = parent
            elif roll < 0.75:
                policy.access(rng.choice(list(stored)))
            else:  # evict like a tier: the first candidate goes
                victim = next(iter(policy.candidates()), None)
                assert victim is not None, "stored keys but no candidate"
                policy.forget(victim)
                del stored[victim]
            if len(chains) > 64:
                chains = chains[-32:]
            if check and step % 25 == 0:
                self._check_victims(policy, stored)

    def _check_victims(self, policy: EvictionPolicy,
                       stored: dict[Hashable, Hashable | None]) -> None:
        victims = list(policy.victims())
        assert len(victims) == len(set(victims)), "victims() yields a key twice"
        extra = [k for k in victims if k not in stored]
        assert not extra, f"victims() yields keys that are not stored: {extra[:3]}"
        parents = {p for p in stored.values() if p is not None}
        leaves = {k for k in stored if k not in parents}
        missed = leaves - set(policy.candidates())
        assert not missed, f"a full pass of candidates() misses stored leaves: {list(missed)[:3]}"
        assert all(k in leaves for k in policy.candidates())

    def test_the_class_passes_lmkvs_load_check(self) -> None:
        if self.policy_class is None:
            pytest.fail("set policy_class on the kit's subclass")
        problem = load_problem(self.policy_class)
        assert not problem, f"lmkv would leave this policy out at load: {problem}"

    def test_victims_are_stored_keys_each_once_and_cover_the_leaves(self) -> None:
        self._random_walk(self.make_policy(), self.operations, check=True)

    def test_candidates_are_leaves_tails_first(self) -> None:
        policy = self.make_policy()
        keys = [self.key(i) for i in range(4)]
        for i, key in enumerate(keys):
            policy.insert(key, keys[i - 1] if i else None)
        for expected in reversed(keys):
            assert list(policy.candidates()) == [expected]
            policy.forget(expected)
        assert list(policy.candidates()) == []

    def test_removing_everything_leaves_nothing_to_evict(self) -> None:
        policy = self.make_policy()
        self._random_walk(policy, self.operations // 2, check=False)
        for key in list(policy.lineage._parent):
            policy.forget(key)
        assert list(policy.victims()) == []
        assert list(policy.candidates()) == []
        assert len(policy.lineage) == 0

    def test_slots_are_ordered_as_keys_are(self) -> None:
        """A policy that says it orders slots (``orders_slots``) gives, slot for key,
        the candidates it gives when handed keys, through the same random walk
        (chains, reads, evictions, an inner key removed now and then), with slots
        numbered as a tier numbers them: a slot goes to another key once its key
        has left and no stored key extends it, and keys that left come back (into
        whichever slot is free then). A policy that remembers keys that left must
        not remember them by slot."""
        if not self.make_policy().orders_slots:
            pytest.skip("this policy orders keys only (orders_slots is False)")
        by_key, by_slot = self.make_policy(), self.make_policy()
        key_of: dict[int, Hashable] = {}  # slot -> the key it holds now
        slot_of: dict[Hashable, int] = {}  # key -> its slot while it holds one
        free: list[int] = []
        by_slot.order_slots(lambda slot: key_of[slot])
        rng = random.Random(self.seed)
        stored: list[Hashable] = []
        gone: list[Hashable] = []

        def claim(key: Hashable) -> int:
            slot = slot_of.get(key)
            if slot is None:
                slot = free.pop() if free else len(key_of)
                key_of[slot], slot_of[key] = key, slot
            return slot

        def release(key: Hashable | None) -> None:
            """Give ``key``'s slot back when nothing stored names it."""
            slot = None if key is None else slot_of.get(key)
            if slot is None or key in stored or by_slot.lineage.children(slot):
                return
            del slot_of[key], key_of[slot]
            free.append(slot)

        fresh = 0
        for step in range(self.operations):
            roll = rng.random()
            if roll < 0.45 or not stored:
                if gone and rng.random() < 0.4:  # a key that left comes back
                    key = gone.pop(rng.randrange(len(gone)))
                else:
                    key, fresh = self.key(fresh), fresh + 1
                parent = stored[-1] if stored and rng.random() < 0.7 else None
                parent_slot = None if parent is None else slot_of[parent]
                by_key.insert(key, parent)
                by_slot.insert(claim(key), parent_slot)
                stored.append(key)
            elif roll < 0.75:
                chosen = rng.choice(stored)
                by_key.access(chosen)
                by_slot.access(slot_of[chosen])
            else:
                if roll > 0.95:
                    victim = rng.choice(stored)
                else:  # each policy is asked, as its tier would ask it
                    victim = next(iter(by_key.candidates()))
                    assert next(iter(by_slot.candidates())) == slot_of[victim], \
                        f"another victim at step {step}"
                slot = slot_of[victim]
                above = by_slot.lineage.parent(slot)  # the parent's slot, or None
                by_key.forget(victim)
                by_slot.forget(slot)
                stored.remove(victim)
                gone.append(victim)
                release(victim)
                if above is not None:
                    release(key_of.get(int(above)))  # type: ignore[call-overload]
            if step % 10 == 0:
                assert [slot_of[k] for k in by_key.candidates()] == \
                    list(by_slot.candidates()), f"the orders part at step {step}"

    def test_batches_are_ordered_as_one_key_at_a_time(self) -> None:
        """``insert_many`` and ``access_many`` (what a tier calls for a batch, and
        what the optional ``on_insert_many`` / ``on_access_many`` hooks serve) leave
        the policy as ``insert`` and ``access`` key by key do: the same candidates
        after every batch of a random walk of prompts stored as batches (chains
        from a stored key or a root, parents out of order, a key extended by one
        stored before it), read as batches, and evicted. Run with slots when the
        policy orders slots, with keys otherwise."""
        one, many = self.make_policy(), self.make_policy()
        slots = one.orders_slots
        if slots:
            one.order_slots(self.key)
            many.order_slots(self.key)
        name = (lambda i: i) if slots else self.key
        told: tuple[list, list] = ([], [])
        one.watch(lambda key, stored: told[0].append((key, stored)))
        many.watch(lambda key, stored: told[1].append((key, stored)))
        rng = random.Random(self.seed)
        stored: list[int] = []
        gone: list[int] = []  # ids that left: taken again, as a tier reuses a slot
        fresh = 0
        for step in range(self.operations // 3):
            roll = rng.random()
            if roll < 0.5 or not stored:
                n = rng.randint(1, 6)
                ids = []
                for _ in range(n):
                    back = [i for i in gone if not one.lineage.children(name(i))]
                    if back and rng.random() < 0.4:
                        ids.append(back[0])
                        gone.remove(back[0])
                    else:
                        ids.append(fresh)
                        fresh += 1
                head = rng.choice(stored) if stored and rng.random() < 0.6 else None
                parents: list[int | None] = [head, *ids[:-1]]
                if rng.random() < 0.2 and n > 1:  # a tail stored before its head
                    i = rng.randrange(1, n)
                    ids[i - 1], ids[i] = ids[i], ids[i - 1]
                    parents[i - 1], parents[i] = parents[i], parents[i - 1]
                if rng.random() < 0.1 and stored:  # a parent from elsewhere
                    parents[-1] = rng.choice(stored)
                keys = [name(i) for i in ids]
                named = [None if p is None else name(p) for p in parents]
                for key, parent in zip(keys, named, strict=True):
                    one.insert(key, parent)
                many.insert_many(keys, named)
                stored += ids
            elif roll < 0.8:
                reads = [name(i) for i in rng.sample(stored, min(len(stored), 5))]
                for key in reads:
                    one.access(key)
                many.access_many(reads)
            else:
                for _ in range(rng.randint(1, 4)):
                    victim = next(iter(one.candidates()), None)
                    if victim is None:
                        break
                    assert next(iter(many.candidates()), None) == victim, \
                        f"another victim at step {step}"
                    one.forget(victim)
                    many.forget(victim)
                    left: Any = victim  # a slot, or a key of self.key's
                    left = left if slots else int.from_bytes(left.chunk_hash, "little")
                    stored.remove(left)
                    gone.append(left)
            assert list(one.candidates()) == list(many.candidates()), \
                f"the orders part at step {step}"
            assert len(one.lineage) == len(many.lineage), f"the lineages part at step {step}"
            assert told[0] == told[1], f"the watchers were told apart at step {step}"

    def test_memory_does_not_grow_with_keys_that_went_through(self) -> None:
        """Churn: a window of at most 64 stored keys, many keys through it. What the
        policy keeps after 10x more churn may not grow by more than a few KiB."""
        policy = self.make_policy()
        rng = random.Random(self.seed)
        live: list[tuple[CacheKey, int]] = []
        counter = [0]

        def churn(n: int) -> None:
            for _ in range(n):
                key = self.key(counter[0])
                counter[0] += 1
                parent = live[-1][0] if live and rng.random() < 0.5 else None
                policy.insert(key, parent)
                live.append((key, 0))
                if rng.random() < 0.5:
                    policy.access(rng.choice(live)[0])
                while len(live) > 64:
                    victim = next(iter(policy.candidates()))
                    policy.forget(victim)
                    live[:] = [(k, c) for k, c in live if k != victim]

        churn(1000)
        gc.collect()
        tracemalloc.start()
        try:
            churn(200)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            churn(3000)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        # 3000 keys leaking even 40 bytes each would be ~120 KB.
        assert after - before < 48 * 1024, f"memory grew by {after - before} bytes over 3000 keys"

    # -- inside a real tier ----------------------------------------------------------
    def test_no_orphaned_prefix_in_a_small_tier(self) -> None:
        rng = random.Random(self.seed)
        tier = self.make_tier(self.tier_entries)
        try:
            prompts = self._prompts(rng, 80)
            seen: dict[int, int | None] = {}
            for p in prompts:
                for i, c in enumerate(p):
                    seen[c] = p[i - 1] if i else None
            for _ in range(self.operations // 5):
                self._request(tier, rng.choice(prompts))
                for c, parent in seen.items():
                    if parent is not None and tier.contains(self.key(c)):
                        assert tier.contains(self.key(parent)), \
                            f"chunk {c} is stored but its parent {parent} is not"
        finally:
            tier.close()

    def test_the_orphan_scenario_keeps_the_head(self) -> None:
        """A 4-chunk prompt in a 4-chunk tier, read, plus one more store: chunks 0-2 stay."""
        tier = self.make_tier(4)
        if not 4 * self.chunk_bytes <= tier.capacity_bytes < 5 * self.chunk_bytes:
            tier.close()
            pytest.skip("the chunk shape does not fill the smallest arena exactly")
        try:
            self._request(tier, [0, 1, 2, 3])
            self._request(tier, [0, 1, 2, 3])
            self._request(tier, [9])
            assert self._stored(tier, [0, 1, 2, 3, 9]) == [True, True, True, False, True]
        finally:
            tier.close()

    def test_pinned_and_referenced_entries_are_never_evicted(self) -> None:
        rng = random.Random(self.seed)
        tier = self.make_tier(self.tier_entries)
        held = []
        try:
            self._request(tier, [1000, 1001, 1002])
            pinned = [self.key(1000), self.key(1001)]
            assert tier.batched_async_contains("pin", pinned, pin=True) == 2
            self._request(tier, [2000])
            held.append(tier.get_blocking(self.key(2000)))
            assert held[0] is not None
            for prompt in self._prompts(rng, 60):
                self._request(tier, prompt)
                assert self._stored(tier, [1000, 1001, 2000]) == [True, True, True]
        finally:
            for obj in held:
                obj.ref_down()
            tier.unpin(self.key(1000))
            tier.unpin(self.key(1001))
            tier.close()

    def test_usage_is_back_to_zero_once_everything_is_removed(self) -> None:
        rng = random.Random(self.seed)
        tier = self.make_tier(self.tier_entries)
        try:
            prompts = self._prompts(rng, 40)
            for prompt in prompts:
                self._request(tier, prompt)
            assert tier.usage_bytes > 0
            ids = sorted({c for p in prompts for c in p}, key=lambda _: rng.random())
            for c in ids:
                tier.remove(self.key(c))
            assert tier.usage_bytes == 0 and len(tier) == 0
            assert list(tier.policy.victims()) == []
        finally:
            tier.close()
