"""The lmkv storage contract, against a real mooncake_master on loopback."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from mooncake_helpers import OwnStoreEdits, new_tier

from lmkv.contracts import StorageBackend
from lmkv.testing import StorageBackendConformance
from lmkv.testing.mooncake import MooncakeMaster
from lmkv_mooncake import MooncakeBackend

pytestmark = pytest.mark.slow  # a real mooncake_master


class TestMooncake(OwnStoreEdits, StorageBackendConformance):
    backend_class = MooncakeBackend
    master: MooncakeMaster

    def backend_options(self) -> dict[str, Any]:
        return self.master.options(key_prefix=f"t-{uuid.uuid4().hex[:8]}:")

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster, shared_client: None) -> None:
        self.master = mooncake_master

    def make_backend(self) -> StorageBackend:
        return new_tier(self.master)

    def process_options(self, backend: StorageBackend) -> dict[str, Any]:
        """The other process lends no segment: what it stores lands in this
        process's (``shared_client``), which outlives it, as a pool's would."""
        return {**super().process_options(backend), "global_segment_size": 0}

    # make_unreachable is left alone: a restarted master has lost what it held (the
    # suite wants it back), and a hung one holds each call for Mooncake's 30 s RPC
    # timeout. test_mooncake_faults kills and restarts a master instead.

