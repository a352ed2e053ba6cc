"""Fixtures: a real mooncake_master on loopback and tier factories."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from mooncake_helpers import new_tier

from lmkv.testing.mooncake import MooncakeMaster, require_mooncake
from lmkv.testing.tiers import strict_refcounts


@pytest.fixture(autouse=True)
def _strict_refcounts() -> Iterator[None]:
    """A double release is a bug: raise in tests instead of logging."""
    with strict_refcounts():
        yield


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("LMKV_", "MOONCAKE_")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One master for the session (tests keep apart by key prefix)."""
    require_mooncake()
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield master
    master.stop()


@pytest.fixture(scope="session")
def shared_client(mooncake_master: MooncakeMaster) -> Iterator[None]:
    """Keeps the process's Mooncake client for the master's default options open
    for the session: tiers made meanwhile share it, so closing one does not pay
    Mooncake's close (a second or two, holding the GIL)."""
    tier = new_tier(mooncake_master)
    yield
    tier.close()


@pytest.fixture
def make_tier(mooncake_master: MooncakeMaster) -> Iterator[Callable[..., object]]:
    """Tiers of the session's master, each under its own key prefix; closed after."""
    made = []

    def make(master: MooncakeMaster | None = None, **options: object) -> object:
        tier = new_tier(master or mooncake_master, **options)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
