"""Entry point of lmkv's built-in policies (group ``lmkv``, name ``lmkv_policies``)."""

from __future__ import annotations

from lmkv.plugins import hookimpl
from lmkv_policies.fifo import FIFOOffloadPolicy
from lmkv_policies.fifo_max_age import FIFOMaxAgeOffloadPolicy
from lmkv_policies.lru import LRUPolicy


@hookimpl
def lmkv_eviction_policies() -> list[type]:
    return [LRUPolicy]


@hookimpl
def lmkv_offload_policies() -> list[type]:
    return [FIFOOffloadPolicy, FIFOMaxAgeOffloadPolicy]
