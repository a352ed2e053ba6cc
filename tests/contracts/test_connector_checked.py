"""Which connectors' ``from_checked_chunks`` lmkv calls (``checked_loads``, GPU
connector API 2.2): one a class written for 2.2 defines, never a method of that
name a class written for 2.1 had of its own, and not where a class below it
copies its own way (its own ``from_chunks``)."""

from __future__ import annotations

import torch

from lmkv.contracts.connector import ConnectorContext, GPUConnector, KVSpec, checked_loads
from lmkv.testing.building import load_problem
from lmkv_backends.connectors.paged import PagedConnector

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


class Base(GPUConnector):
    name = "checked-base"
    api_version = "2.2"

    def to_chunks(self, spans, **kv):  # type: ignore[no-untyped-def]
        pass

    def from_chunks(self, spans, **kv):  # type: ignore[no-untyped-def]
        pass


class Checks(Base):
    def from_checked_chunks(self, spans, checksums, **kv):  # type: ignore[no-untyped-def]
        return [True] * len(spans)


class Older(Checks):
    """Written for 2.1: a method of that name was its own business."""

    api_version = "2.1"

    def from_checked_chunks(self, spans, checksums, **kv):  # type: ignore[no-untyped-def]
        return ["something else"]


class CopiesItsOwnWay(Checks):
    def from_chunks(self, spans, **kv):  # type: ignore[no-untyped-def]
        pass


class Inherits(Checks):
    name = "checked-inherits"


def built(cls: type[GPUConnector]) -> GPUConnector:
    return cls(None, ConnectorContext(SPEC))


def test_lmkv_calls_a_2_2_classs_checked_loads_and_none_other() -> None:
    assert checked_loads(built(Checks)) is not None
    assert checked_loads(built(Inherits)) is not None
    assert checked_loads(built(Base)) is None  # (the base class checks nothing)
    assert checked_loads(built(Older)) is None
    assert checked_loads(built(CopiesItsOwnWay)) is None
    assert checked_loads(built(PagedConnector)) is not None


def test_the_load_check_binds_a_2_2_classs_checked_loads() -> None:
    class TakesNoChecksums(Base):
        def from_checked_chunks(self, spans):  # type: ignore[no-untyped-def]
            return None

    class OlderTakesNoChecksums(TakesNoChecksums):
        api_version = "2.1"

    assert "from_checked_chunks(spans, checksums" in load_problem(TakesNoChecksums)
    # (a class written for 2.1 is not checked for it: lmkv never calls it then)
    assert load_problem(OlderTakesNoChecksums) == ""
    assert checked_loads(built(OlderTakesNoChecksums)) is None
    assert load_problem(Checks) == ""


def test_a_21_subclass_of_lmkvs_connector_keeps_its_checked_loads() -> None:
    class Named(PagedConnector):
        name = "paged-named"
        api_version = "2.1"

    assert checked_loads(built(Named)) is not None


def test_the_base_class_checks_nothing() -> None:
    assert Base(None, ConnectorContext(SPEC)).from_checked_chunks([], []) is None
