"""The lmkv storage contract, against a real mooncake_master on loopback."""

from __future__ import annotations

import pytest
from mooncake_servers import MooncakeMaster, new_tier

from lmkv import StorageBackend
from lmkv.testing import StorageBackendConformance
from lmkv.tokens import CacheKey


class TestMooncake(StorageBackendConformance):
    master: MooncakeMaster

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster, shared_client: None) -> None:
        self.master = mooncake_master

    def make_backend(self) -> StorageBackend:
        return new_tier(self.master)

    def corrupt_entry(self, backend: StorageBackend, key: CacheKey) -> bool:
        """Flip a payload bit, with the store's own client (get, remove, put)."""
        store, name = _own_store(backend), backend.store_key(key)
        frame = bytearray(store.get(name))
        frame[-10] ^= 1
        assert store.remove(name, True) == 0
        assert store.put(name, bytes(frame)) == 0
        return True

    def copy_entry(self, backend: StorageBackend, source: CacheKey, target: CacheKey) -> bool:
        """Store source's whole frame under target's name."""
        store = _own_store(backend)
        frame = store.get(backend.store_key(source))
        store.remove(backend.store_key(target), True)
        assert store.put(backend.store_key(target), frame) == 0
        return True

    # make_unreachable is left alone: a restarted master has lost what it held (the
    # suite wants it back), and a hung one holds each call for Mooncake's 30 s RPC
    # timeout. test_mooncake_faults kills and restarts a master instead.


def _own_store(backend: StorageBackend) -> object:
    with backend.link.using() as store:  # the tier's own client, behind its back
        return store
