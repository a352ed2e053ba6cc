"""Entry point of the ``peer`` tier (group ``lmkv``, name ``lmkv_fleet``)."""

from __future__ import annotations

from lmkv.contracts.hooks import hookimpl
from lmkv.fleet.tier import PeerBackend


@hookimpl
def lmkv_storage_backends() -> list[type]:
    return [PeerBackend]
