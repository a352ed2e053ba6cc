"""A third-party plugin package written against lmkv 0.1, and its port to 0.2.

``lmkv-legacy`` 0.1.0 is what a plugin author shipped for lmkv 0.1: a tier, an
eviction policy, an offload policy and a serializer, written to that
release's contract (old import paths, ``batched_submit_put(keys, objs)``, a
tier that drives its policy's ``on_*`` hooks itself, policies built with their
options alone, serializers that do not take the key). lmkv 0.2 must leave each
class out at load with one line, everywhere, and never crash.

``lmkv-legacy`` 0.2.0 is the same package ported as docs/migrating-plugins.md
says: it imports from ``lmkv.contracts`` only, declares ``api_version``, and
passes the conformance kits with every built-in eviction policy.
"""

from __future__ import annotations

from pathlib import Path

from tests.plugins.plugin_fixtures import write_dist

LEGACY_SOURCE = '''
import threading
import zlib
from collections import OrderedDict

from lmkv.backend import BackendContext, StorageBackend, done_future
from lmkv.plugin_base import PluginOptions
from lmkv.plugins import hookimpl
from lmkv.policy import EvictionPolicy, OffloadItem, OffloadPolicy
from lmkv.serde import Serializer


class LegacyOptions(PluginOptions):
    max_entries: int = 64


class LegacyTier(StorageBackend):
    """Frames in a dict; evicts through its policy's hooks, as tiers did in 0.1."""

    name = "legacy"
    Options = LegacyOptions

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.frames = {}
        self.pins = {}
        self.lock = threading.Lock()

    def contains(self, key, pin=False):
        with self.lock:
            if key not in self.frames:
                return False
            if pin:
                self.pins[key] = self.pins.get(key, 0) + 1
            return True

    def batched_submit_put(self, keys, objs):
        policy = self.context.eviction_policy
        with self.lock:
            for key, obj in zip(keys, objs):
                while len(self.frames) >= self.options.max_entries:
                    victim = next(policy.victims())
                    del self.frames[victim]
                    policy.on_remove(victim)
                self.frames[key] = self.context.serializer.frame_bytes(obj)
                policy.on_insert(key)
        return done_future(len(keys))

    def get_blocking(self, key):
        frame = self.frames.get(key)
        if frame is None:
            return None
        self.context.eviction_policy.on_access(key)
        return self.context.serializer.deserialize(frame, self.context.allocate)

    def pin(self, key):
        return self.contains(key, pin=True)

    def unpin(self, key):
        with self.lock:
            if key in self.pins:
                self.pins[key] -= 1
            return key in self.frames

    def remove(self, key):
        with self.lock:
            self.context.eviction_policy.on_remove(key)
            return self.frames.pop(key, None) is not None

    @property
    def usage_bytes(self):
        return sum(len(f) for f in self.frames.values())


class OldestFirst(EvictionPolicy):
    name = "oldest-first"

    def __init__(self, options=None):
        super().__init__(options)
        self.order = OrderedDict()

    def on_insert(self, key):
        self.order[key] = None

    def on_access(self, key):
        self.order.move_to_end(key)

    def on_remove(self, key):
        self.order.pop(key, None)

    def victims(self):
        return iter(list(self.order))


class EveryFinished(OffloadPolicy):
    name = "EVERY_FINISHED"

    def __init__(self, options=None, *, threshold):
        super().__init__(options, threshold=threshold)
        self.items = OrderedDict()

    def add(self, meta, block_hashes):
        self.items.setdefault(meta.req_id, OffloadItem(meta.req_id)).metas.append(meta)

    def mark_req_finished(self, req_id):
        self.items[req_id].finished = True

    def pop_items_for_offload(self, count):
        done = [i for i in self.items.values() if i.finished][:count]
        for item in done:
            del self.items[item.req_id]
        return done

    @property
    def ready_count(self):
        return sum(i.finished for i in self.items.values())

    def __len__(self):
        return len(self.items)


class Deflate(Serializer):
    name = "deflate"
    serializer_id = 150

    def serialize(self, obj):
        return [zlib.compress(obj.tensor.numpy().tobytes())]

    def deserialize(self, frame, allocate):
        raise NotImplementedError


@hookimpl
def lmkv_storage_backends():
    return [LegacyTier]


@hookimpl
def lmkv_eviction_policies():
    return [OldestFirst]


@hookimpl
def lmkv_offload_policies():
    return [EveryFinished]


@hookimpl
def lmkv_serializers():
    return [Deflate]
'''

PORTED_SOURCE = '''
import threading
from collections import OrderedDict

from lmkv.contracts import (
    EvictionPolicy,
    OffloadItem,
    OffloadPolicy,
    PluginOptions,
    Serializer,
    StorageBackend,
    done_future,
    hookimpl,
)


class LegacyOptions(PluginOptions):
    max_entries: int = 64


class LegacyTier(StorageBackend):
    """Frames in a dict; evicts through its policy, the 2.0 way."""

    name = "legacy"
    api_version = "2.0"
    Options = LegacyOptions

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.frames = {}
        self.pins = {}
        self.lock = threading.Lock()

    def contains(self, key, pin=False):
        with self.lock:
            if key not in self.frames:
                return False
            if pin:
                self.pins[key] = self.pins.get(key, 0) + 1
            return True

    def batched_submit_put(self, keys, objs, parents=None):
        policy = self.context.eviction_policy
        parents = parents if parents is not None else [None] * len(keys)
        stored = 0
        with self.lock:
            for key, obj, parent in zip(keys, objs, parents):
                if key in self.frames:
                    continue
                while len(self.frames) >= self.options.max_entries:
                    victim = next((k for k in policy.candidates()
                                   if not self.pins.get(k)), None)
                    if victim is None:
                        break
                    del self.frames[victim]
                    policy.forget(victim)
                    self.counters.evictions += 1
                if len(self.frames) >= self.options.max_entries:
                    self.counters.dropped_writes += 1
                    continue
                self.frames[key] = self.context.serializer.frame_bytes(obj, key)
                policy.insert(key, parent)
                stored += 1
        self.counters.puts += stored
        return done_future(stored)

    def get_blocking(self, key):
        frame = self.frames.get(key)
        if frame is None:
            self.counters.misses += 1
            return None
        obj = self.decode_frame(key, frame)
        if obj is None:
            self.counters.misses += 1
            return None
        self.context.eviction_policy.access(key)
        self.counters.hits += 1
        return obj

    def pin(self, key):
        return self.contains(key, pin=True)

    def unpin(self, key):
        with self.lock:
            if key not in self.frames:
                return False
            if self.pins.get(key):
                self.pins[key] -= 1
            return True

    def remove(self, key):
        with self.lock:
            self.pins.pop(key, None)
            if self.frames.pop(key, None) is None:
                return False
            self.context.eviction_policy.forget(key)
            return True

    @property
    def usage_bytes(self):
        return sum(len(f) for f in self.frames.values())


class OldestFirst(EvictionPolicy):
    name = "oldest-first"
    api_version = "2.0"

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.order = OrderedDict()

    def on_insert(self, key, parent):
        self.order[key] = None

    def on_access(self, key):
        self.order.move_to_end(key)

    def on_remove(self, key):
        self.order.pop(key, None)

    def victims(self):
        return iter(list(self.order))


class EveryFinished(OffloadPolicy):
    name = "EVERY_FINISHED"
    api_version = "2.0"

    def __init__(self, options, context):
        super().__init__(options, context)
        self.items = OrderedDict()

    def add(self, meta, block_hashes):
        self.items.setdefault(meta.req_id, OffloadItem(meta.req_id)).metas.append(meta)

    def mark_req_finished(self, req_id):
        if req_id not in self.items:
            raise ValueError(f"{req_id} is not pending")
        self.items[req_id].finished = True

    def pop_items_for_offload(self, count):
        if count <= 0 or self.ready_count < self.threshold:
            return []
        done = [i for i in self.items.values() if i.finished][:count]
        for item in done:
            del self.items[item.req_id]
        return done

    @property
    def ready_count(self):
        return sum(i.finished for i in self.items.values())

    def __len__(self):
        return len(self.items)


class Deflate(Serializer):
    """Raw bytes in a frame (the 2.0 frame helpers bind it to its key)."""

    name = "deflate"
    api_version = "2.0"
    serializer_id = 150

    def serialize(self, obj, key):
        payload = memoryview(obj.tensor.contiguous().view(-1).view(torch.uint8).numpy())
        return self.framed(obj, payload, key)

    def deserialize(self, frame, allocate, key):
        header, payload = self.open_frame(frame, key)
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        obj.tensor.view(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(payload, numpy.uint8)
        return obj


@hookimpl
def lmkv_storage_backends():
    return [LegacyTier]


@hookimpl
def lmkv_eviction_policies():
    return [OldestFirst]


@hookimpl
def lmkv_offload_policies():
    return [EveryFinished]


@hookimpl
def lmkv_serializers():
    return [Deflate]
'''.replace("import threading\n", "import threading\n\nimport numpy\nimport torch\n", 1)

#: The classes of the legacy package, as ``(kind title, name)``.
LEGACY_CLASSES = [("storage backend", "legacy"), ("eviction policy", "oldest-first"),
                  ("offload policy", "EVERY_FINISHED"), ("serializer", "deflate")]


def write_legacy(root: Path) -> Path:
    """``lmkv-legacy`` 0.1.0 on ``root`` (put ``root`` on sys.path / PYTHONPATH)."""
    return write_dist(root, "lmkv-legacy", "lmkv_legacy", LEGACY_SOURCE, version="0.1.0")


def write_ported(root: Path) -> Path:
    """``lmkv-legacy`` 0.2.0, ported to lmkv 0.2's contract."""
    return write_dist(root, "lmkv-legacy", "lmkv_legacy", PORTED_SOURCE, version="0.2.0")
