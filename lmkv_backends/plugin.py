"""Entry point of lmkv's built-in tiers, serializer and GPU connectors
(group ``lmkv``, name ``lmkv_backends``)."""

from __future__ import annotations

from lmkv.contracts.hooks import hookimpl
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.connectors.paged import PagedConnector
from lmkv_backends.serde.int8 import Int8Serializer
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.serde.zstd import ZstdSerializer
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_backends.tiers.fs import FSBackend


@hookimpl
def lmkv_storage_backends() -> list[type]:
    return [CPUBackend, FSBackend]


@hookimpl
def lmkv_serializers() -> list[type]:
    return [NaiveSerializer, ZstdSerializer, Int8Serializer]


@hookimpl
def lmkv_gpu_connectors() -> list[type]:
    return [HFConnector, PagedConnector]
