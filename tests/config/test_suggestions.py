"""'did you mean': a key is suggested only when it is plausibly what was meant."""

from __future__ import annotations

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import load_config
from lmkv.config.suggestions import nearest

LOOKUP_KEYS = ["backoff_ms", "base_port", "curve", "host", "insecure", "max_tokens",
               "runtime_dir", "timeout_ms", "transport"]


@pytest.mark.parametrize(("name", "allowed", "meant"), [
    ("port", LOOKUP_KEYS, "base_port"),          # a whole word of one key
    ("timeout", LOOKUP_KEYS, "timeout_ms"),
    ("transprot", LOOKUP_KEYS, "transport"),     # two neighbours swapped
    ("hosts", LOOKUP_KEYS, "host"),              # a letter added
    ("chunksize", ["chunk_size", "tiers"], "chunk_size"),
    ("evicton", ["admit_after", "eviction", "options", "type"], "eviction"),
    ("opts", ["options", "type"], "options"),    # an abbreviation
    ("prt", ["host", "port"], "port"),
    ("CONFIGG", ["CHUNK_SIZE", "CONFIG"], "CONFIG"),
])
def test_plausible_keys_are_suggested(name: str, allowed: list[str], meant: str) -> None:
    assert nearest(name, allowed) == meant


@pytest.mark.parametrize(("name", "allowed"), [
    ("zzz", LOOKUP_KEYS),
    ("ms", LOOKUP_KEYS),                # a word of two keys: which one is a guess
    ("size", ["max_bytes", "huge_pages"]),
    ("colour", ["greeting"]),
])
def test_nothing_is_suggested_when_nothing_is_plausible(name: str, allowed: list[str]) -> None:
    assert nearest(name, allowed) is None


def test_lookup_port_is_not_told_transport() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.lookup.port": 5555})
    message = str(info.value)
    assert "'transport'?" not in message
    assert message.startswith("config key 'lookup.port' (from lmkv.lookup.port): unknown "
                              "key; did you mean 'base_port'? allowed: backoff_ms, base_port")


def test_an_env_variable_gets_a_variable_only_when_plausible() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_LOOKUP__PORT": "5555"})
    assert "did you mean LMKV_LOOKUP__BASE_PORT?" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_LOOKUP__ZZZ": "1"})
    assert "did you mean" not in str(info.value)
