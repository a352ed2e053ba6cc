"""The load check's edge cases: what lmkv can call is taken, what it cannot is
left out, and a class that breaks the looking at it breaks nothing else."""

from __future__ import annotations

import functools

from lmkv.contracts import GPUConnector, StorageBackend, done_future
from lmkv.plugins.contract import check, declared_version
from lmkv.plugins.registry import PluginSource, Registry
from lmkv.testing import plugin_class


class Minimal(StorageBackend):
    """A whole tier in few lines: the base for the variants below."""

    name = "minimal"
    api_version = "2.0"

    def contains(self, key, pin=False):
        return False

    def batched_submit_put(self, keys, objs, parents=None):
        return done_future(0)

    def get_blocking(self, key):
        return None

    def pin(self, key):
        return False

    def unpin(self, key):
        return False

    def remove(self, key):
        return False

    @property
    def usage_bytes(self):
        return 0


def problem(cls: type, kind: str = "storage_backend", base: type = StorageBackend) -> str:
    return check(kind, cls, base).problem


def test_a_whole_tier_is_taken() -> None:
    assert problem(Minimal) == ""


def test_a_capacity_given_as_a_plain_value_is_a_property_lmkv_can_read() -> None:
    class Valued(Minimal):
        capacity_bytes = None

    assert problem(Valued) == ""


def test_a_cached_property_is_a_property() -> None:
    class Cached(Minimal):
        @functools.cached_property
        def usage_bytes(self):  # type: ignore[override]
            return 0

    assert problem(Cached) == ""


def test_a_static_method_is_not_a_property() -> None:
    class Static(Minimal):
        usage_bytes = staticmethod(lambda: 0)  # type: ignore[assignment]

    assert "usage_bytes is a method" in problem(Static)


def test_contains_must_take_pin_as_an_optional_keyword() -> None:
    class PinRequired(Minimal):
        def contains(self, key, pin):  # type: ignore[override]
            return False

    assert "contains(self, key, pin) cannot be called as contains(key)" in problem(PinRequired)


def test_parents_must_be_optional_too() -> None:
    class ParentsRequired(Minimal):
        def batched_submit_put(self, keys, objs, parents):  # type: ignore[override]
            return done_future(0)

    assert "cannot be called as batched_submit_put(keys, objs)" in problem(ParentsRequired)


def test_a_connector_names_the_engine_keywords_as_it_likes() -> None:
    class Positional(GPUConnector):
        name = "positional"
        api_version = "2.0"

        def to_chunks(self, spans, kv_caches, block_ids, after=None):
            pass

        def from_chunks(self, spans, kv_caches, block_ids, after=None):
            pass

    class NoAfter(Positional):
        def to_chunks(self, spans, *, kv_caches, block_ids):  # type: ignore[override]
            pass

    assert problem(Positional, "gpu_connector", GPUConnector) == ""
    assert "cannot be called as to_chunks(spans, after=..., **engine_state)" in problem(
        NoAfter, "gpu_connector", GPUConnector)


def test_a_built_in_lends_no_api_version_to_a_subclass() -> None:
    cpu = plugin_class("storage_backend", "cpu")

    class Subclass(cpu):  # type: ignore[misc, valid-type]
        name = "sub-cpu"

    assert declared_version(cpu, StorageBackend) == "2.2"
    assert declared_version(Subclass, StorageBackend) is None
    assert check("storage_backend", Subclass, StorageBackend).undeclared


def test_a_class_that_breaks_the_looking_at_it_is_recorded_not_raised() -> None:
    class Exploding(type(StorageBackend)):  # type: ignore[misc]
        @property
        def name(cls):  # a metaclass property wins over the class's own name
            raise RuntimeError("boom")

    class Weird(Minimal, metaclass=Exploding):
        pass

    registry = Registry()
    registry.add_all("storage_backend", [Weird, Minimal], PluginSource("p", "dist-x", "1"))
    assert registry.names("storage_backend") == ["minimal"]
    (failure,) = registry.failures
    assert failure.source.distribution == "dist-x" and "RuntimeError: boom" in failure.error
