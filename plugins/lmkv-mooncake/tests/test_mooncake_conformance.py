"""The lmkv storage contract, against a real mooncake_master on loopback."""

from __future__ import annotations

import pytest
from mooncake_servers import MooncakeMaster, OwnStoreEdits, new_tier

from lmkv import StorageBackend
from lmkv.testing import StorageBackendConformance


class TestMooncake(OwnStoreEdits, StorageBackendConformance):
    master: MooncakeMaster

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster, shared_client: None) -> None:
        self.master = mooncake_master

    def make_backend(self) -> StorageBackend:
        return new_tier(self.master)

    # make_unreachable is left alone: a restarted master has lost what it held (the
    # suite wants it back), and a hung one holds each call for Mooncake's 30 s RPC
    # timeout. test_mooncake_faults kills and restarts a master instead.

