"""The storage-backend kit on the ``peer`` tier: the tier under test is an
instance that serves nothing (no ``listen``), so every key it stores is pushed
to the fleet's other instance, a real storage manager with a cpu tier and its
endpoint on a private ipc socket, and every read comes back from there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmkv import load_config
from lmkv.contracts import StorageBackend
from lmkv.fleet.endpoint import PeerEndpoint
from lmkv.fleet.tier import PeerBackend
from lmkv.storage import StorageManager
from lmkv.testing import StorageBackendConformance


class TestPeerTierKit(StorageBackendConformance):
    backend_class = PeerBackend

    @pytest.fixture(autouse=True)
    def owner(self, tmp_path: Path) -> Iterator[StorageManager]:
        self.address = f"ipc://{tmp_path}/fleet/owner.sock"
        config = load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "cpu", "options": {"max_bytes": "256MiB"}},
            {"type": "peer", "options": {"listen": self.address, "peers": [self.address]}}]})
        owner = StorageManager.from_config(config)
        self._owner = owner
        yield owner
        owner.close()

    def backend_options(self) -> dict[str, Any]:
        return {"peers": [self.address], "timeout_ms": 2000}

    def make_unreachable(self, backend: StorageBackend):  # type: ignore[no-untyped-def]
        @contextlib.contextmanager
        def stopped() -> Iterator[None]:
            tier = self._owner.tiers[1]
            endpoint = tier.endpoint
            endpoint.close()
            try:
                yield
            finally:
                tier.endpoint = PeerEndpoint(endpoint.tier, endpoint.serializer,
                                             self.address).start()
        return stopped()

    def test_remove_frees_usage(self, backend: StorageBackend) -> None:
        pytest.skip("the peer tier holds nothing itself: what it stores is its owners' "
                    "(their cpu tiers' usage)")

    def test_a_put_lands_at_the_owner(self, backend: StorageBackend) -> None:
        key = self.key(1)
        obj = self.make_obj(backend, 1)
        assert backend.batched_submit_put([key], [obj]).result(30) == 1
        assert self._owner.tiers[0].contains(key)
