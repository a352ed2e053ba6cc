"""Entry point of lmkv's built-in policies (group ``lmkv``, name ``lmkv_policies``)."""

from __future__ import annotations

from lmkv.contracts.hooks import hookimpl
from lmkv_policies.arc import ARCPolicy
from lmkv_policies.fifo import FIFOOffloadPolicy
from lmkv_policies.fifo_max_age import FIFOMaxAgeOffloadPolicy
from lmkv_policies.lfu import LFUPolicy
from lmkv_policies.lru import LRUPolicy
from lmkv_policies.s3fifo import S3FIFOPolicy


@hookimpl
def lmkv_eviction_policies() -> list[type]:
    return [LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy]


@hookimpl
def lmkv_offload_policies() -> list[type]:
    return [FIFOOffloadPolicy, FIFOMaxAgeOffloadPolicy]
