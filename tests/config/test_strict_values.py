"""Values lmkv once accepted silently: each is now one line naming the key, the value
and what is allowed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import MAX_CHUNK_TOKENS, load_config


def one_line(overrides: dict | None = None, env: dict | None = None, path: Path | None = None
             ) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {}, overrides=overrides)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize("key", ["chunk_size", "block_size"])
def test_chunk_tokens_are_bounded(key: str) -> None:
    assert one_line({f"lmkv.{key}": 10**30}) == (
        f"config key '{key}' = {10**30} (from lmkv.{key}): must be a positive integer of "
        f"at most {MAX_CHUNK_TOKENS} (tokens)")
    assert "positive integer" in one_line({f"lmkv.{key}": 0})
    config = load_config(env={}, overrides={"lmkv.chunk_size": MAX_CHUNK_TOKENS,
                                            "lmkv.block_size": MAX_CHUNK_TOKENS})
    assert config.chunk_size == MAX_CHUNK_TOKENS


@pytest.mark.parametrize("tiers", [
    ["cpu", "cpu"],
    ["cpu", {"type": "CPU", "options": {"max_bytes": "4GiB"}}],  # the defaults, written out
    [{"type": "cpu", "options": {"max_bytes": "64MiB"}, "eviction": "lru"},
     {"type": "cpu", "options": {"max_bytes": "64MiB"}, "eviction": "lfu"}],
])
def test_two_identical_tiers_are_refused(tiers: list) -> None:
    assert one_line({"lmkv.tiers": tiers}) == (
        "config key 'tiers.1' (from lmkv.tiers): the same tier as tiers.0 (type 'cpu', the "
        "same options); allowed: tiers that differ in type or options (remove tiers.1, or "
        "change its options)")


def test_two_identical_fs_tiers_are_refused_and_different_ones_pass(tmp_path: Path) -> None:
    fs = {"type": "fs", "options": {"url": str(tmp_path / "kv")}}
    assert "the same tier as tiers.1" in one_line(
        {"lmkv.tiers": ["cpu", fs, {**fs}]})
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        {"type": "cpu", "options": {"max_bytes": "128MiB"}}, fs]})
    assert len(config.tiers) == 3


@pytest.mark.parametrize(("overrides", "env", "key", "shown"), [
    ({"lmkv.save_partial_chunk": "yes"}, {}, "save_partial_chunk", "'yes'"),
    ({}, {"LMKV_SAVE_PARTIAL_CHUNK": "yes"}, "save_partial_chunk", "'yes'"),
    ({"lmkv.async_load": 1}, {}, "async_load", "1"),
    ({"lmkv.lookup.insecure": "on"}, {}, "lookup.insecure", "'on'"),
    ({"lmkv.tiers.0.options.pin_memory": "yes"}, {}, "tiers.0.options.pin_memory", "'yes'"),
    ({"lmkv.tiers.0.options.huge_pages": 0}, {}, "tiers.0.options.huge_pages", "0"),
])
def test_booleans_are_true_or_false_only(overrides: dict, env: dict, key: str,
                                         shown: str) -> None:
    message = one_line(overrides, env)
    assert message.startswith(f"config key '{key}' = {shown} (from ")
    assert message.endswith("): must be true or false")


def test_true_and_false_still_read_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("save_partial_chunk: true\ntiers: [{type: cpu, options: "
                    "{pin_memory: false, max_bytes: 64MiB}}]\n")
    config = load_config(path, env={"LMKV_ASYNC_LOAD": "true"},
                         overrides={"lmkv.layerwise": "true", "lmkv.store_decode": False})
    assert (config.save_partial_chunk, config.async_load, config.layerwise,
            config.store_decode) == (True, True, True, False)
    assert config.plugins.tiers[0].backend.options.pin_memory is False


def test_lmkv_config_naming_no_file_is_an_error_even_beside_a_given_file(
        tmp_path: Path) -> None:
    given = tmp_path / "given.yaml"
    given.write_text("chunk_size: 128\n")
    gone = tmp_path / "gone.yaml"
    assert one_line(path=given, env={"LMKV_CONFIG": str(gone)}) == (
        f"LMKV_CONFIG = '{gone}': cannot read it (no such file), and it is checked even "
        f"when a config file is given ({given}); allowed: a config file (.yaml, .toml or "
        ".json), or LMKV_CONFIG unset")
    assert "(a directory)" in one_line(overrides={"lmkv.config_file": str(given)},
                                       env={"LMKV_CONFIG": str(tmp_path)})
    # Alone, it is the config file: its errors are a config file's.
    assert one_line(env={"LMKV_CONFIG": str(gone)}).startswith(
        f"config file {gone}: cannot read it")


def test_a_given_file_wins_over_lmkv_config_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    given, other = tmp_path / "given.yaml", tmp_path / "other.yaml"
    given.write_text("chunk_size: 128\n")
    other.write_text("chunk_size: 512\n")
    with caplog.at_level(logging.WARNING, logger="lmkv.config.model"):
        assert load_config(given, env={"LMKV_CONFIG": str(other)}).chunk_size == 128
    assert [r.getMessage() for r in caplog.records] == [
        f"lmkv: LMKV_CONFIG={other} is not read: the config file given, {given}, wins "
        "over it"]
    caplog.clear()
    assert load_config(env={"LMKV_CONFIG": str(other)}).chunk_size == 512
    assert load_config(given, env={"LMKV_CONFIG": str(given)}).chunk_size == 128
    assert not caplog.records
