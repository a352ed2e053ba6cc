"""Mutants of a correct tier and policy, each one of the ways a plugin passed the
0.1 kits and then broke at run time. Not collected on its own (no ``test_``
prefix): ``test_kit_mutants.py`` runs the kits against each in a pytest of its
own and checks that the named kit tests fail.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lmkv_kernels
from lmkv.contracts import ChunkSpan, EvictionPolicy, KVSpec, StorageBackend, done_future
from lmkv.testing import EvictionPolicyConformance, StorageBackendConformance, plugin_class
from tests.plugins.test_legacy_plugin import PORTED
from tests.testing.test_connector_kit import PagedKit

Tier = PORTED["LegacyTier"]  # a correct frame tier (the kits pass it)
Policy = PORTED["OldestFirst"]  # a correct policy


class OldWayTier(Tier):
    """Ported, but drives its policy the 0.1 way: the hooks, not insert/access/forget."""

    name = "mutant-old-way"

    def batched_submit_put(self, keys, objs, parents=None):
        policy = self.context.eviction_policy
        for key, obj in zip(keys, objs, strict=True):
            self.frames[key] = self.context.serializer.frame_bytes(obj, key)
            policy.on_insert(key)  # 0.1: no parent; a 2.0 policy needs one
        return done_future(len(keys))


class ParentDroppingTier(Tier):
    """Calls insert, but drops the parents lmkv gave it."""

    name = "mutant-no-parents"

    def batched_submit_put(self, keys, objs, parents=None):
        return super().batched_submit_put(keys, objs, None)


class NoParentsParameterTier(Tier):
    """Kept 0.1's signature of batched_submit_put."""

    name = "mutant-old-signature"

    def batched_submit_put(self, keys, objs):  # type: ignore[override]
        return super().batched_submit_put(keys, objs)


class AbstractTier(StorageBackend):
    """Half written: no get_blocking, pin, unpin."""

    name = "mutant-abstract"
    api_version = "2.0"

    def contains(self, key, pin=False):
        return False

    def batched_submit_put(self, keys, objs, parents=None):
        return done_future(0)

    def remove(self, key):
        return False

    @property
    def usage_bytes(self):
        return 0


class HandBuiltPolicy(Policy):
    """Passed a kit that built it by hand: lmkv builds it with a context."""

    name = "mutant-hand-built"

    def __init__(self, options=None):
        super().__init__(options, None)


CPU = plugin_class("storage_backend", "cpu")


class NoRefCPU(CPU):  # type: ignore[misc, valid-type]
    """Hands callers the tier's own reference: their release frees a stored buffer."""

    name = "mutant-no-ref"
    api_version = "2.0"

    def get_blocking(self, key):
        obj = super().get_blocking(key)
        if obj is not None:
            obj.ref_down()  # the caller's reference, given back behind its back
        return obj


class MemoryWithoutBuffers(Tier):
    """Says it holds memory, and hands out no buffers."""

    name = "mutant-no-buffers"
    holds_memory_objs = True


class NameTaken(CPU):  # type: ignore[misc, valid-type]
    """Inherits the name ``cpu``: a kit that built lmkv's own tier would pass it."""

    api_version = "2.0"

    def get_blocking(self, key):
        raise RuntimeError("never reached by a kit that tests this class")


FS = plugin_class("storage_backend", "fs")


class MisplacedMapFS(FS):  # type: ignore[misc, valid-type]
    """Reads its mapped entries from the file's first byte: the header comes out
    as KV (a direct chunk's mapping must start at its payload)."""

    name = "mutant-misplaced-map"
    api_version = "2.1"

    def _get_direct(self, key, nowait=False):
        got = super()._get_direct(key, nowait)
        mapped = getattr(got, "_mapped", None)
        if mapped is not None:
            mapped._start = 0
        return got


class TestMisplacedMapFS(StorageBackendConformance):
    backend_class = MisplacedMapFS

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path

    def backend_options(self):
        return {"url": str(self.root), "durable": False}


class TestNoRefCPU(StorageBackendConformance):
    backend_class = NoRefCPU
    outlives_process = False

    def backend_options(self):
        return {"max_bytes": 1 << 20}


class TestMemoryWithoutBuffers(StorageBackendConformance):
    backend_class = MemoryWithoutBuffers
    outlives_process = False


class TestNameTaken(StorageBackendConformance):
    backend_class = NameTaken
    outlives_process = False

    def backend_options(self):
        return {"max_bytes": 1 << 20}


class TestOldWayTier(StorageBackendConformance):
    outlives_process = False  # a dict in its process
    backend_class = OldWayTier


class TestParentDroppingTier(StorageBackendConformance):
    outlives_process = False  # a dict in its process
    backend_class = ParentDroppingTier


class TestNoParentsParameterTier(StorageBackendConformance):
    outlives_process = False  # a dict in its process
    backend_class = NoParentsParameterTier


class TestAbstractTier(StorageBackendConformance):
    outlives_process = False  # a dict in its process
    backend_class = AbstractTier


class TestHandBuiltPolicy(EvictionPolicyConformance):
    policy_class = HandBuiltPolicy

    def make_policy(self) -> EvictionPolicy:  # what the 0.1 kit let a plugin do
        return HandBuiltPolicy()


Paged = plugin_class("gpu_connector", "paged")


class CanonicalIntoOuter(Paged):  # type: ignore[misc, valid-type]
    """Says its chunks are held heads outer (as cpu caches get them) but fills and
    reads them in the canonical order: with two KV heads the shapes agree, the
    round trip holds, and every other engine of the layout would read scrambled KV."""

    name = "mutant-canonical-into-outer"
    api_version = "2.1"
    chunk_layout = "lht2d"  # (its copies are its own: paged would name them l2thd)

    @classmethod
    def spec_from(cls, **kv):
        return replace(super().spec_from(**kv), heads_outer=True)

    def to_chunks(self, spans, *, kv_caches, block_ids, after=None, **_):
        lmkv_kernels.gather_blocks(kv_caches, block_ids, [(s.start, s.buffer) for s in spans],
                                   layout="cpu")

    def from_chunks(self, spans, *, kv_caches, block_ids, skip_tokens=0, after=None, **_):
        lmkv_kernels.scatter_blocks(kv_caches, block_ids, [(s.start, s.buffer) for s in spans],
                                    skip_tokens, layout="cpu")


class ClaimsOuterOnCanonicalSpec(Paged):  # type: ignore[misc, valid-type]
    """Copies of its own (canonical, on the inherited spec) but says ``lht2d``: its
    chunks would be named as heads-outer ones, which other engines read so."""

    name = "mutant-claims-outer"
    api_version = "2.1"
    chunk_layout = "lht2d"

    def to_chunks(self, spans, **kv):
        return super().to_chunks(spans, **kv)

    def from_chunks(self, spans, **kv):
        return super().from_chunks(spans, **kv)


class OuterChunksCanonicalName(Paged):  # type: ignore[misc, valid-type]
    """Moves heads-outer chunks but names them ``l2thd``: the canonical order's tag."""

    name = "mutant-outer-named-canonical"
    api_version = "2.1"

    def __init__(self, options, context):
        super().__init__(options, context)
        self.chunk_layout = "l2thd"


class TrustsEveryChecksum(Paged):  # type: ignore[misc, valid-type]
    """Copies whole chunks in checked loads and says every checksum matched."""

    name = "mutant-trusts-every-checksum"
    api_version = "2.2"

    def from_checked_chunks(self, spans, checksums, **kv):
        self.from_chunks([ChunkSpan(s.start, s.end, s.buffer.narrow(2, 0, s.end - s.start))
                          for s in spans], **kv)
        return [True] * len(spans)


class TestCanonicalIntoOuter(PagedKit):
    connector_class = CanonicalIntoOuter
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


class TestClaimsOuterOnCanonicalSpec(PagedKit):
    connector_class = ClaimsOuterOnCanonicalSpec
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


class TestOuterChunksCanonicalName(PagedKit):
    connector_class = OuterChunksCanonicalName


class TestTrustsEveryChecksum(PagedKit):
    connector_class = TrustsEveryChecksum
