from __future__ import annotations

import argparse

import pytest

from lmkv.base.errors import ConfigError, byte_size_type
from lmkv.base.units import parse_byte_size
from lmkv.config.model import load_config


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4096", 4096), ("512MiB", 512 << 20), ("1.5 GiB", 3 << 29),
    ("10GB", 10 * 10**9), ("8kb", 8000), (" 2MiB ", 2 << 20), ("7B", 7),
])
def test_accepted_sizes(text: object, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", [
    "8GB!", "1,5GiB", "1  GiB", "GiB", "1.GiB", ".5GiB", "-1GiB", "12 parsecs", "", True, 1.5,
    None, [1],
])
def test_loose_sizes_are_refused(text: object) -> None:
    with pytest.raises(ValueError, match="a unit: B, KB"):
        parse_byte_size(text)


# Every byte-size option of the built-in tiers and the redis plugin uses the strict type.
@pytest.mark.parametrize("tier,key", [
    ({"type": "cpu"}, "max_bytes"),
    ({"type": "fs", "options": {"url": "/tmp/lmkv-units"}}, "max_bytes"),
    ({"type": "redis"}, "part_bytes"),
    ({"type": "redis"}, "pipeline_bytes"),
    ({"type": "redis"}, "max_pending_bytes"),
])
@pytest.mark.parametrize("bad", ["8GB!", "1,5GiB"])
def test_every_byte_size_option_is_strict(tier: dict, key: str, bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.tiers.0": tier, f"lmkv.tiers.0.options.{key}": bad})
    message = str(info.value)
    assert message.splitlines() == [
        f"config key 'tiers.0.options.{key}' = {bad!r} (from lmkv.tiers.0.options.{key}): "
        "must be a byte count or a number (decimal point allowed), optional space and a "
        "unit: B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB (e.g. 4096, 512MiB, 1.5 GiB)"]


def test_server_flag_is_strict() -> None:
    assert byte_size_type(4096)("64MiB") == 64 << 20
    with pytest.raises(argparse.ArgumentTypeError, match="'8GB!': must be a byte count"):
        byte_size_type(4096)("8GB!")


def _byte_size_fields() -> list[tuple[str, str]]:
    from pydantic import ByteSize

    from lmkv.plugins.manager import get_plugin_manager

    found = []
    for entry in get_plugin_manager().registry.entries():
        for field_name, field in entry.cls.Options.model_fields.items():
            if "ByteSize" in repr(field.annotation) or isinstance(field.default, ByteSize):
                found.append((f"{entry.kind}:{entry.name}", field_name))
    return found


def test_every_installed_plugins_byte_sizes_are_strict() -> None:
    """No plugin option declared with pydantic's prefix-matching ByteSize slips through."""
    from lmkv.plugins.manager import get_plugin_manager

    fields = _byte_size_fields()
    assert ("storage_backend:cpu", "max_bytes") in fields
    assert ("storage_backend:redis", "part_bytes") in fields
    classes = {f"{e.kind}:{e.name}": e.cls for e in get_plugin_manager().registry.entries()}
    for plugin, field_name in fields:
        options = classes[plugin].Options
        for bad in ("8GB!", "1,5GiB"):
            errors = _errors_for(options, field_name, bad)
            assert [e["type"] for e in errors if e["loc"] == (field_name,)] == ["byte_size"], (
                plugin, field_name, bad)


def _errors_for(options: type, field_name: str, value: str) -> list[dict]:
    from pydantic import ValidationError

    try:
        options.model_validate({field_name: value})
    except ValidationError as exc:
        return exc.errors()
    return []
