"""Tiers of a test master and edits behind a tier's back, for the mooncake
tier's tests (the master and the real client themselves are
``lmkv.testing.mooncake``'s)."""

from __future__ import annotations

import uuid
from typing import Any

from lmkv.contracts import MemoryAllocator
from lmkv.testing.mooncake import MooncakeMaster, MooncakeRealClient
from lmkv.testing.tiers import open_tier

_ARENAS: list[MemoryAllocator] = []


def new_tier(master: MooncakeMaster | MooncakeRealClient, **options: Any) -> Any:
    """A tier of ``master`` under its own key prefix (unless given), with its own arena."""
    options.setdefault("key_prefix", f"t-{uuid.uuid4().hex[:8]}:")
    tier = open_tier("mooncake", master.options(**options), arena_bytes=16 << 20)
    # Kept for the session: the process's shared Mooncake client keeps the arena
    # registered, and a later arena at an overlapping address would be refused
    # (-600), sending its chunks through staging instead of the direct path.
    _ARENAS.append(tier.context.allocate.__self__)
    return tier


class OwnStoreEdits:
    """``corrupt_entry`` and ``copy_entry`` of the conformance kit, done with the
    tier's own Mooncake client behind its back."""

    def corrupt_entry(self, backend: Any, key: Any) -> bool:
        """Flip a payload bit (get, remove, put)."""
        store, name = own_store(backend), backend.store_key(key)
        frame = bytearray(store.get(name))
        frame[-10] ^= 1
        assert store.remove(name, True) == 0
        assert store.put(name, bytes(frame)) == 0
        return True

    def copy_entry(self, backend: Any, source: Any, target: Any) -> bool:
        """Store source's whole frame under target's name."""
        store = own_store(backend)
        frame = store.get(backend.store_key(source))
        store.remove(backend.store_key(target), True)
        assert store.put(backend.store_key(target), frame) == 0
        return True


def own_store(backend: Any) -> Any:
    with backend.link.using() as store:  # the tier's own client, behind its back
        return store
