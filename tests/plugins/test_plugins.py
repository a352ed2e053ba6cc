from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from lmkv.base.errors import DuplicatePluginError, PluginError, UnknownPluginError
from lmkv.plugins import hookimpl
from lmkv.plugins.manager import PluginManager
from lmkv.plugins.registry import KINDS, PluginSource, Registry
from lmkv.testing import registered_plugin
from lmkv_backends.tiers.cpu import CPUBackend
from lmkv_policies.lru import LRUPolicy
from tests.conftest import run_cli
from tests.plugins.plugin_fixtures import (
    OUR_DISTRIBUTIONS,
    write_broken_plugin,
    write_hello_plugin,
)


class Shadow(CPUBackend):
    name = "CPU"  # names are case-insensitive: this collides with the built-in


class DuplicatePlugin:
    @hookimpl
    def lmkv_storage_backends(self):
        return Shadow


def test_builtins_register_through_entry_points() -> None:
    manager = PluginManager()
    manager.load_entry_points()
    names = {(e.kind, e.name): e.source for e in manager.registry.entries()}
    for key in [("storage_backend", "cpu"), ("eviction_policy", "lru"),
                ("offload_policy", "FIFO"), ("serializer", "naive"),
                ("gpu_connector", "hf"), ("gpu_connector", "paged")]:
        assert key in names
        assert names[key].distribution == "lmkv"


def test_every_builtin_is_built_by_the_one_constructor_rule() -> None:
    """``cls(options, context)`` everywhere: options may be None, and the context
    may be left out exactly where every field of the kind's context has a default."""
    from lmkv.contracts.connector import ConnectorContext
    from lmkv.contracts.policy import EvictionContext, OffloadContext
    from lmkv.contracts.serde import SerializerContext
    from lmkv.contracts.tier import BackendContext

    contexts = {"storage_backend": BackendContext, "eviction_policy": EvictionContext,
                "offload_policy": OffloadContext, "serializer": SerializerContext,
                "gpu_connector": ConnectorContext}
    manager = PluginManager()
    manager.load_entry_points()
    classes = [(e.kind, e.cls) for e in manager.registry.entries()]
    classes += [(k.key, k.base_class()) for k in KINDS.values()]
    redis = pytest.importorskip("lmkv_redis.backend")
    classes.append(("storage_backend", redis.RedisBackend))
    for kind, cls in classes:
        required = any(f.default is dataclasses.MISSING
                       and f.default_factory is dataclasses.MISSING
                       for f in dataclasses.fields(contexts[kind]))
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert [p.name for p in params] == ["options", "context"], cls
        default = inspect.Parameter.empty if required else None
        assert [p.default for p in params] == [default, default], cls
    assert {k for k, c in contexts.items() if any(
        f.default is dataclasses.MISSING for f in dataclasses.fields(c))} == {
        "offload_policy", "gpu_connector"}


def test_lookup_is_case_insensitive() -> None:
    manager = PluginManager()
    manager.load_entry_points()
    assert manager.offload_policy("fifo") is manager.offload_policy("FIFO")


def test_a_name_clash_with_a_builtin_is_recorded_and_the_builtin_wins() -> None:
    with registered_plugin(DuplicatePlugin(), name="dup") as manager:
        assert manager.storage_backend("cpu") is CPUBackend
        (failure,) = [f for f in manager.registry.failures if f.source.plugin == "dup"]
        assert "DuplicatePluginError" in failure.error and "registered twice" in failure.error
        assert "the built-in wins" in failure.error


def test_unknown_name_lists_available_and_pip_command(monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "lmkv-redis" not in p])
    monkeypatch.setattr("lmkv.plugins.manager.entry_points", lambda group: [
        ep for ep in entry_points(group=group) if ep.name != "lmkv-redis"])
    manager = PluginManager()
    manager.load_entry_points()
    with pytest.raises(UnknownPluginError) as info:
        manager.storage_backend("redis")
    assert "available: cpu" in str(info.value)
    assert "pip install lmkv-redis" in str(info.value)
    with pytest.raises(UnknownPluginError, match="unknown storage backend 'nope'; available"):
        manager.storage_backend("nope")


def test_hook_must_return_plugin_classes() -> None:
    class Bad:
        @hookimpl
        def lmkv_eviction_policies(self):
            return [object]

    with registered_plugin(Bad(), name="bad") as manager:
        (failure,) = [f for f in manager.registry.failures if f.source.plugin == "bad"]
        assert "expected a subclass" in failure.error
        assert manager.eviction_policy("lru") is LRUPolicy


def test_every_kind_has_a_hook() -> None:
    from lmkv.contracts import hooks as hookspecs

    for kind in KINDS.values():
        assert hasattr(hookspecs, kind.hook)
        assert kind.base_class().__name__


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_hello_plugin(tmp_path)
    write_broken_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith(("lmkv_hello", "lmkv_broken"))]:
        del sys.modules[mod]


def test_third_party_plugin_is_discovered(third_party: Path) -> None:
    manager = PluginManager()
    manager.load_entry_points()
    backend = manager.storage_backend("hello")
    assert backend.__module__ == "lmkv_hello.plugin"
    entry = next(e for e in manager.registry.entries() if e.name == "hello")
    assert (entry.source.distribution, entry.source.version) == ("lmkv-hello", "1.0")
    assert manager.eviction_policy("newest-first")


def test_broken_plugin_is_recorded_not_fatal(third_party: Path) -> None:
    manager = PluginManager()
    manager.load_entry_points()
    assert manager.storage_backend("cpu") is CPUBackend
    (failure,) = [f for f in manager.registry.failures
                  if f.source.distribution == "lmkv-broken"]
    assert "not_a_real_module_for_lmkv_tests" in failure.error
    with pytest.raises(UnknownPluginError, match="failed to load"):
        manager.storage_backend("something-broken-provides")


def test_allow_and_block_lists(third_party: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMKV_DISABLE_PLUGINS", "lmkv-hello")
    manager = PluginManager()
    manager.load_entry_points()
    assert "hello" not in manager.registry.names("storage_backend")
    assert any(s.source.distribution == "lmkv-hello" for s in manager.skipped)

    monkeypatch.delenv("LMKV_DISABLE_PLUGINS")
    monkeypatch.setenv("LMKV_LOAD_PLUGINS", "lmkv_policies")
    manager = PluginManager()
    manager.load_entry_points()
    assert manager.registry.names("storage_backend") == []
    assert manager.eviction_policy("lru") is LRUPolicy


@pytest.mark.slow  # lmkv commands in processes
def test_cli_lists_plugins_and_errors(third_party: Path) -> None:
    env = {"PYTHONPATH": str(third_party)}
    result = run_cli("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {(p["kind"], p["name"]): p for p in data["plugins"]}
    assert rows[("storage_backend", "hello")]["distribution"] == "lmkv-hello"
    assert rows[("storage_backend", "cpu")]["version"]
    assert any("not_a_real_module" in e["error"] for e in data["errors"])

    table = run_cli("plugins", env=env)
    assert table.returncode == 0
    assert "hello" in table.stdout and "lmkv-broken" in table.stdout


@pytest.mark.slow  # lmkv commands in processes
def test_third_party_plugin_selected_by_config(third_party: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "hello.yaml"
    cfg.write_text("tiers:\n  - type: hello\n    options: {greeting: hi}\n"
                   "    eviction: newest-first\n")
    result = run_cli("config", "check", str(cfg), env={"PYTHONPATH": str(third_party)})
    assert result.returncode == 0, result.stderr
    assert "greeting: hi" in result.stdout

    cfg.write_text("tiers:\n  - type: hello\n    options: {colour: red}\n")
    result = run_cli("config", "check", str(cfg), env={"PYTHONPATH": str(third_party)})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmkv: error")]
    assert errors == [f"lmkv: error: config key 'tiers.0.options.colour' (from {cfg}): "
                      "unknown key; allowed: greeting, max_bytes"]
    assert "Traceback" not in result.stderr


def test_an_entry_point_name_taken_by_another_distribution_is_reported(tmp_path: Path,
                                                                       monkeypatch) -> None:
    from tests.plugins.plugin_fixtures import write_dist

    source = "from lmkv.plugins import hookimpl\n"
    write_dist(tmp_path / "a", "lmkv-one", "lmkv_one", source)
    write_dist(tmp_path / "b", "lmkv-two", "lmkv_two", source)
    # both declare the entry point name of their own dist; make them collide
    for d, dist in (("a", "lmkv_one"), ("b", "lmkv_two")):
        (tmp_path / d / f"{dist}-1.0.dist-info" / "entry_points.txt").write_text(
            f"[lmkv]\nshared-name = {dist}.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    manager = PluginManager()
    manager.load_entry_points()
    (failure,) = [f for f in manager.registry.failures if "shared-name" in f.error]
    assert "already used by" in failure.error


def test_a_module_registered_twice_is_a_load_failure_not_a_crash() -> None:
    import lmkv_policies.plugin as builtin

    manager = PluginManager()
    manager.register(builtin, name="first")
    manager.load_entry_points()  # lmkv_policies' entry point loads the same module
    assert manager.eviction_policy("lru") is LRUPolicy
    assert any(f.source.plugin == "lmkv_policies" for f in manager.registry.failures)


def test_hook_errors_are_one_line_and_recorded_once() -> None:
    class Exploding:
        @hookimpl
        def lmkv_serializers(self):
            raise RuntimeError("first line\nsecond line")

    with registered_plugin(Exploding(), name="exploding") as manager:
        failures = [f for f in manager.registry.failures if f.source.plugin == "exploding"]
        assert [f.error for f in failures] == ["RuntimeError: first line second line"]
        manager.register(object(), name="another")  # forces a rebuild
        assert len([f for f in manager.registry.failures
                    if f.source.plugin == "exploding"]) == 1


def test_skipped_plugins_are_named_in_unknown_name_errors(monkeypatch) -> None:
    monkeypatch.setenv("LMKV_LOAD_PLUGINS", "lmkv_policies")
    manager = PluginManager()
    manager.load_entry_points()
    with pytest.raises(UnknownPluginError, match="skipped by LMKV_LOAD_PLUGINS"):
        manager.storage_backend("cpu")


def test_duplicate_message_names_the_first_registration_first() -> None:
    with registered_plugin(DuplicatePlugin(), name="dup") as manager:
        (failure,) = [f for f in manager.registry.failures if f.source.plugin == "dup"]
        assert re.search(r"by lmkv_backends .* and by dup", failure.error)


def test_registry_add_still_raises_for_direct_callers() -> None:
    registry = Registry()
    registry.add("storage_backend", CPUBackend, PluginSource("a"))
    with pytest.raises(DuplicatePluginError, match="registered twice"):
        registry.add("storage_backend", Shadow, PluginSource("b"))
    with pytest.raises(PluginError, match="expected a subclass"):
        registry.add("storage_backend", "cpu", PluginSource("b"))


def test_a_known_plugin_that_is_disabled_says_so(monkeypatch) -> None:
    pytest.importorskip("lmkv_redis")
    monkeypatch.setenv("LMKV_DISABLE_PLUGINS", "lmkv-redis")
    manager = PluginManager()
    manager.load_entry_points()
    with pytest.raises(UnknownPluginError, match="lmkv-redis, which is installed but skipped"):
        manager.storage_backend("redis")


BAD_PLUGINS = {
    # dist: (module source, the problem `lmkv plugins` must show)
    "lmkv-shadow": ("""
from lmkv.plugins import hookimpl
from lmkv_backends.tiers.cpu import CPUBackend

class Shadow(CPUBackend):
    name = "CPU"

@hookimpl
def lmkv_storage_backends():
    return Shadow
""", "the built-in wins"),
    "lmkv-nameless": ("""
from lmkv.plugins import hookimpl
from lmkv.contracts.policy import EvictionPolicy

class Nameless(EvictionPolicy):
    pass

@hookimpl
def lmkv_eviction_policies():
    return [Nameless]
""", "has no `name`"),
    "lmkv-notaclass": ("""
from lmkv.plugins import hookimpl

@hookimpl
def lmkv_storage_backends():
    return "not a class"
""", "expected a subclass"),
    "lmkv-bigid": ("""
from lmkv.plugins import hookimpl
from lmkv_backends.serde.naive import NaiveSerializer

class Big(NaiveSerializer):
    name = "big"
    serializer_id = 300

@hookimpl
def lmkv_serializers():
    return Big
""", "serializer_id = 300; allowed: an integer from 1 to 255"),
    "lmkv-dupid": ("""
from lmkv.plugins import hookimpl
from lmkv_backends.serde.naive import NaiveSerializer

class Twin(NaiveSerializer):
    name = "twin"
    serializer_id = 1

@hookimpl
def lmkv_serializers():
    return Twin
""", "serializer_id 1 is used twice"),
}


@pytest.fixture
def bad_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from tests.plugins.plugin_fixtures import write_dist

    root = tmp_path / "site"
    for dist, (source, _) in BAD_PLUGINS.items():
        write_dist(root, dist, dist.replace("-", "_"), source)
    write_hello_plugin(root)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for mod in [m for m in sys.modules if m.startswith(("lmkv_hello", "lmkv_shadow",
                                                        "lmkv_nameless", "lmkv_notaclass",
                                                        "lmkv_bigid", "lmkv_dupid"))]:
        del sys.modules[mod]


def test_bad_plugins_are_recorded_and_never_fatal(bad_plugins: Path) -> None:
    from lmkv_backends.serde.naive import NaiveSerializer

    manager = PluginManager()
    manager.load_entry_points()
    assert manager.storage_backend("cpu") is CPUBackend
    assert manager.serializer("naive") is NaiveSerializer
    assert manager.storage_backend("hello")  # a good third-party plugin still works
    assert "big" not in manager.registry.names("serializer")
    assert "twin" not in manager.registry.names("serializer")
    errors = {f.source.distribution: f.error for f in manager.registry.failures}
    for dist, (_, problem) in BAD_PLUGINS.items():
        assert problem in errors[dist], (dist, errors.get(dist))
        assert "\n" not in errors[dist]


@pytest.mark.slow  # lmkv commands in processes
def test_cli_lists_bad_plugins_and_a_cpu_config_still_works(bad_plugins: Path,
                                                            tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(bad_plugins)}
    table = run_cli("plugins", env=env)
    assert table.returncode == 0, table.stderr
    assert "Traceback" not in table.stderr
    listed = {(row[0], row[1], row[3]) for row in map(str.split, table.stdout.splitlines())
              if len(row) >= 4}
    assert ("storage_backend", "cpu", "lmkv") in listed
    assert ("storage_backend", "hello", "lmkv-hello") in listed
    failed = table.stdout.split("plugins left out (see docs/migrating-plugins.md):")[1]
    for dist, (_, problem) in BAD_PLUGINS.items():
        (line,) = [x for x in failed.splitlines() if f"({dist} 1.0)" in x]
        assert problem in line
    # the clash warning names both distributions, on one line
    (warning,) = [x for x in table.stderr.splitlines() if "registered twice" in x]
    assert "(lmkv " in warning and "(lmkv-shadow 1.0)" in warning

    cfg = tmp_path / "cpu.yaml"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: 1MiB}}]\n")
    check = run_cli("config", "check", str(cfg), env=env)
    assert check.returncode == 0, check.stderr


# -- resolution once, at config load; one constructor shape --------------------

def test_a_loaded_config_carries_its_plugins_resolved_and_typed() -> None:
    from lmkv.config.model import load_config
    from lmkv_backends.serde.naive import NaiveSerializer
    from lmkv_policies.fifo import FIFOOffloadPolicy

    config = load_config(env={}, overrides={
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "1MiB"}}],
        "lmkv.gpu_connector": {"type": "paged"}})
    plugins = config.plugins
    (tier,) = plugins.tiers
    assert tier.backend.cls is CPUBackend and tier.backend.options.max_bytes == 1 << 20
    assert tier.eviction.cls is LRUPolicy
    assert plugins.serializer.cls is NaiveSerializer
    assert plugins.offload_policy.cls is FIFOOffloadPolicy
    assert plugins.gpu_connector.cls.name == "paged"


def test_storage_is_built_from_the_resolved_plugins_without_a_second_look_up() -> None:
    from lmkv.config.model import load_config
    from lmkv.storage.manager import StorageManager
    from lmkv.testing.plugins import fresh_plugin_manager

    config = load_config(env={}, overrides={
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "1MiB"}}]})
    with fresh_plugin_manager(load_entry_points=False):  # no plugin is known by name now
        storage = StorageManager.from_config(config)
    try:
        (tier,) = storage.tiers
        assert isinstance(tier, CPUBackend) and isinstance(tier.policy, LRUPolicy)
        assert tier.context.tier_index == 0
    finally:
        storage.close()


def test_every_bad_reference_of_a_config_is_one_line_and_all_are_reported() -> None:
    from lmkv.base.errors import ConfigError
    from lmkv.config.model import load_config

    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.tiers.0.eviction": "nope",
                                       "lmkv.serializer": {"type": "naive",
                                                           "options": {"level": 3}}})
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("tiers.0.eviction.type = 'nope': unknown eviction policy 'nope'")
    assert lines[1].startswith("config key 'serializer.options.level'")


def test_a_bad_plugin_only_fails_the_config_that_selects_it(bad_plugins: Path) -> None:
    from lmkv.base.errors import ConfigError
    from lmkv.config.model import load_config
    from lmkv.testing.plugins import fresh_plugin_manager

    with fresh_plugin_manager():
        cpu = load_config(env={}, overrides={"lmkv.tiers.0.options.max_bytes": "1MiB"})
        assert cpu.plugins.tiers[0].backend.cls is CPUBackend
        with pytest.raises(ConfigError) as info:
            load_config(env={}, overrides={"lmkv.serializer": "big"})
    (line,) = str(info.value).splitlines()
    assert "unknown serializer 'big'" in line and "lmkv-bigid" in line


def _context_for(kind: str) -> object:
    import torch

    from lmkv.contracts.connector import ConnectorContext, KVSpec
    from lmkv.contracts.policy import EvictionContext, OffloadContext
    from lmkv.contracts.serde import SerializerContext
    from lmkv.contracts.tier import BackendContext
    from lmkv_backends.serde.naive import NaiveSerializer

    return {
        "storage_backend": BackendContext(serializer=NaiveSerializer(),
                                          eviction_policy=LRUPolicy()),
        "eviction_policy": EvictionContext(tier_index=1),
        "offload_policy": OffloadContext(threshold=3),
        "serializer": SerializerContext(),
        "gpu_connector": ConnectorContext(KVSpec(2, 2, 8, torch.float32)),
    }[kind]


# Options every built-in needs to open without side effects outside the test.
_OPTIONS = {("storage_backend", "cpu"): {"max_bytes": "1MiB"},
            ("storage_backend", "fs"): {"url": "{tmp}/fs"},
            ("storage_backend", "redis"): {"url": "redis://127.0.0.1:1"},
            ("storage_backend", "peer"): {"peers": ["ipc://{tmp}/peers/a.sock"]}}


@pytest.mark.slow  # builds the service tiers too
def test_every_installed_plugin_is_built_as_cls_options_context(tmp_path: Path) -> None:
    manager = PluginManager()
    manager.load_entry_points()
    built = []
    for entry in manager.registry.entries():
        if entry.source.distribution not in OUR_DISTRIBUTIONS:
            continue  # a third-party plugin installed beside lmkv: not ours to configure
        raw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else
               [item.format(tmp=tmp_path) for item in v]
               for k, v in _OPTIONS.get((entry.kind, entry.name), {}).items()}
        context = _context_for(entry.kind)
        plugin = entry.cls(entry.cls.Options.model_validate(raw), context)
        assert plugin.context is context
        assert isinstance(plugin.options, entry.cls.Options)
        built.append((entry.kind, entry.name))
        if hasattr(plugin, "close"):
            plugin.close()
    assert {k for k, _ in built} == set(KINDS)


def test_a_bad_offload_threshold_is_refused_by_its_context() -> None:
    from lmkv.contracts.policy import OffloadContext

    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="threshold must be a positive integer"):
            OffloadContext(threshold=bad)


def test_a_copy_or_edit_that_changes_a_plugin_reference_resolves_again() -> None:
    from lmkv.config.model import PluginRef, load_config
    from lmkv_backends.serde.naive import NaiveSerializer
    from lmkv_backends.serde.zstd import ZstdSerializer

    config = load_config(env={})
    assert config.plugins.serializer.cls is NaiveSerializer
    copy = config.model_copy(update={"serializer": PluginRef(type="zstd")})
    assert copy.plugins.serializer.cls is ZstdSerializer
    assert config.plugins.serializer.cls is NaiveSerializer
    config.tiers[0].options["max_bytes"] = "2MiB"
    assert config.plugins.tiers[0].backend.options.max_bytes == 2 << 20


class _GoodHook:
    @hookimpl
    def lmkv_storage_backends(self) -> list[type]:
        return []


class _MisspelledHook:
    @hookimpl
    def lmkv_storage_backend(self) -> list[type]:  # the hook is lmkv_storage_backends
        return [CPUBackend]


def test_a_hookimpl_that_matches_no_hook_is_refused_and_named() -> None:
    manager = PluginManager()
    with pytest.raises(PluginError, match="'lmkv_storage_backend' matches no lmkv hook; "
                                          "did you mean 'lmkv_storage_backends'"):
        manager.register(_MisspelledHook(), name="typo")
    assert "typo" not in manager._sources  # nothing of the refused plugin stays
    assert manager.register(_GoodHook(), name="typo") == "typo"


def test_an_exception_whose_str_raises_is_described_by_its_type() -> None:
    from lmkv.plugins.registry import describe_exception

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError

    assert describe_exception(Unprintable()).startswith("Unprintable (")
    assert describe_exception(SystemExit(3)) == "SystemExit: 3"


def test_env_lists_that_skip_every_plugin_are_one_line(monkeypatch) -> None:
    from lmkv.base.errors import ConfigError
    from lmkv.config.model import load_config

    monkeypatch.setenv("LMKV_LOAD_PLUGINS", ",,,")
    manager = PluginManager()
    manager.load_entry_points()
    with pytest.raises(ConfigError) as info:
        load_config(env={}, plugin_manager=manager)
    (line,) = str(info.value).splitlines()
    assert "LMKV_LOAD_PLUGINS=,,, names no plugin" in line
    assert line.count("LMKV_LOAD_PLUGINS") == 1
    assert "unresolved for the same reason: tiers.0.eviction.type = 'lru'" in line
