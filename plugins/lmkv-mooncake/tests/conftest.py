"""Fixtures: a real mooncake_master on loopback and tier factories."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from mooncake_servers import AVAILABLE, SKIP_REASON, MooncakeMaster

import lmkv.memory
from lmkv import BackendContext
from lmkv.memory import MemoryAllocator


@pytest.fixture(autouse=True)
def _strict_refcounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A double release is a bug: raise in tests instead of logging."""
    monkeypatch.setattr(lmkv.memory, "strict_refcounts", True)


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("LMKV_", "MOONCAKE_")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for the session (tests keep apart by key prefix)."""
    if not AVAILABLE:
        pytest.skip(SKIP_REASON)
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield master
    master.stop()


@pytest.fixture
def make_tier(mooncake_master: MooncakeMaster) -> Iterator[Callable[..., object]]:
    """Tiers of the session's master, each under its own key prefix; closed after."""
    from lmkv_backends.serde.naive import NaiveSerializer
    from lmkv_mooncake import MooncakeBackend, MooncakeOptions

    made = []

    def make(master: MooncakeMaster | None = None, **options: object) -> MooncakeBackend:
        master = master or mooncake_master
        arena = MemoryAllocator(16 << 20, pin_memory=False)
        options.setdefault("key_prefix", f"t-{uuid.uuid4().hex[:8]}:")
        tier = MooncakeBackend(MooncakeOptions(**master.options(**options)),
                               BackendContext(serializer=NaiveSerializer(),
                                              allocate=arena.allocate))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
