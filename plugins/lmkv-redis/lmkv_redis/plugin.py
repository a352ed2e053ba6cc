"""Entry point of lmkv-redis (group ``lmkv``, name ``lmkv-redis``)."""

from __future__ import annotations

from lmkv.contracts import hookimpl
from lmkv_redis.backend import RedisBackend


@hookimpl
def lmkv_storage_backends() -> list[type]:
    return [RedisBackend]
