"""Entry point of lmkv-mooncake (group ``lmkv``, name ``lmkv-mooncake``)."""

from __future__ import annotations

from lmkv.contracts import hookimpl
from lmkv_mooncake.backend import MooncakeBackend


@hookimpl
def lmkv_storage_backends() -> list[type]:
    return [MooncakeBackend]
