"""``open_engine``: the engine kind a config asks for, one ``Engine`` contract for
both, and the GPU connector resolved in one place."""

from __future__ import annotations

import inspect

import pytest
import torch

import lmkv.engines.connector as connector_module
from lmkv import ConfigError, ConnectorContext, KVSpec, load_config
from lmkv.engines import Engine, open_engine, resolve_connector
from lmkv.engines.local import LocalEngine
from lmkv.engines.remote import RemoteEngine
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.connectors.paged import PagedConnector

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def server_config(tmp_path):  # type: ignore[no-untyped-def]
    """Server mode at an address nobody listens on (the engine opens anyway: misses)."""
    return load_config(env={}, overrides={"lmkv.mode": "server",
                                          "lmkv.server.address": f"ipc://{tmp_path}/none.sock",
                                          "lmkv.server.timeout_ms": 50})


def test_without_a_server_the_engine_is_local() -> None:
    with open_engine(load_config(env={}), SPEC, model_name="m") as engine:
        assert isinstance(engine, LocalEngine)
        assert isinstance(engine, Engine)
        assert isinstance(engine.connector, HFConnector)


def test_a_config_naming_a_server_opens_the_remote_engine(tmp_path) -> None:
    with open_engine(server_config(tmp_path), SPEC, model_name="m") as engine:
        assert isinstance(engine, RemoteEngine)
        assert isinstance(engine, Engine)
        assert engine.lookup(list(range(64))) == 0  # nobody answers: a miss, not an error


def _members(cls: type) -> dict[str, inspect.Signature | None]:
    members = {}
    for name in dir(Engine):
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        value = inspect.getattr_static(cls, name, None)
        members[name] = (inspect.signature(value) if inspect.isfunction(value) else None)
    return members


@pytest.mark.parametrize("cls", [LocalEngine, RemoteEngine])
def test_both_engines_have_the_protocols_methods_with_its_signatures(cls: type) -> None:
    """Structural, not only runtime_checkable (which checks names): every method of
    ``Engine`` exists on the class with the same parameters, kinds and defaults."""
    expected = _members(Engine)
    got = _members(cls)
    for name, signature in expected.items():
        if signature is None:
            continue
        assert name in got and got[name] is not None, f"{cls.__name__} lacks {name}"
        want = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        have = [(p.name, p.kind, p.default) for p in got[name].parameters.values()]
        assert have == want, f"{cls.__name__}.{name}"
    assert isinstance(inspect.getattr_static(cls, "meta"), property)


def test_the_connector_is_resolved_once_per_engine(monkeypatch) -> None:
    calls: list[str] = []
    resolve = connector_module.resolve_connector_class

    def counting(config, kv_kind):  # type: ignore[no-untyped-def]
        calls.append(kv_kind)
        return resolve(config, kv_kind)

    monkeypatch.setattr(connector_module, "resolve_connector_class", counting)
    with open_engine(load_config(env={}), SPEC, model_name="m"):
        pass
    assert calls == [None]  # no kind asserted: the config's connector, else hf


def test_the_default_connector_was_resolved_when_the_config_was_loaded(monkeypatch) -> None:
    from lmkv.plugins.manager import PluginManager

    config = load_config(env={})

    def no_more_look_ups(self, name):  # type: ignore[no-untyped-def]
        raise AssertionError(f"gpu_connector {name!r} looked up after load")

    monkeypatch.setattr(PluginManager, "gpu_connector", no_more_look_ups)
    with open_engine(config, SPEC, model_name="m") as engine:
        assert isinstance(engine.connector, HFConnector)


def test_a_given_connector_is_used_as_is(monkeypatch) -> None:
    monkeypatch.setattr(connector_module, "resolve_connector_class", None)  # never called
    connector = HFConnector(None, ConnectorContext(SPEC))
    with open_engine(load_config(env={}), SPEC, model_name="m", connector=connector) as engine:
        assert engine.connector is connector


def test_the_config_connector_wins_over_the_default_and_is_checked_for_kind() -> None:
    config = load_config(env={}, overrides={"lmkv.gpu_connector": "paged"})
    assert isinstance(resolve_connector(config, SPEC, "paged"),
                      PagedConnector)
    with pytest.raises(ConfigError, match="gpu_connector = 'paged': cannot serve a "
                                          "transformers model"):
        open_engine(config, SPEC, model_name="m", kv_kind="hf")

