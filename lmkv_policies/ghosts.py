"""What a policy that remembers keys after they leave (ghosts, counts of evicted
keys) names them by.

Handed keys, a policy names a key by itself. Handed a tier's slots
(``EvictionPolicy.orders_slots``), it cannot: a tier gives a slot to another
key once the one it named has left, and a ghost named by its slot would then
stand for that other key. Such a policy names what it remembers by the hash
of the slot's key, taken while the slot still names it (in ``on_remove``,
and in ``on_insert`` for the key that arrives), or, from lmkv's own tiers,
by ``SlotKeys.name``, which builds no key. Two keys with one name share a
ghost: a decision about what to evict, never which bytes a key reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from lmkv.contracts.policy import EvictionPolicy
from lmkv.keys.slots import SlotKeys


def same_name(key: Hashable) -> Hashable:
    """A key's name when the policy is handed keys: the key."""
    return key


def ghost_name(policy: EvictionPolicy) -> Callable[[Any], Hashable]:
    """A slot's name for ``policy``'s ghosts, taken from the key it names now
    (call from ``use_slots``: ``order_slots`` has set the slot -> key map)."""
    key_of = policy._key_of  # set by the base's order_slots
    assert key_of is not None, "ghost_name before order_slots"
    index = getattr(key_of, "__self__", None)
    if isinstance(index, SlotKeys) and key_of == index.key:
        return index.name
    return lambda slot: hash(key_of(slot))
