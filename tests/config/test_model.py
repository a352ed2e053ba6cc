from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import LMKVConfig, load_config
from tests.conftest import run_cli


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(env={})
    assert config.chunk_size == 256
    assert [t.type for t in config.tiers] == ["cpu"]
    assert config.tiers[0].eviction.type == "lru"
    assert config.serializer.type == "naive"
    assert (config.lazy_offload, config.lazy_offload_policy.type,
            config.lazy_offload_threshold, config.lazy_offload_select_count) == (
        False, "FIFO", 100, 10)
    # "no config" and "default config" are the same thing
    assert config == LMKVConfig()


@pytest.mark.parametrize("name,text", [
    ("c.yaml", "chunk_size: 128\ntiers:\n  - type: cpu\n    options: {max_bytes: 64MiB}\n"),
    ("c.toml", 'chunk_size = 128\n[[tiers]]\ntype = "cpu"\noptions = {max_bytes = "64MiB"}\n'),
    ("c.json", json.dumps({"chunk_size": 128,
                           "tiers": [{"type": "cpu", "options": {"max_bytes": "64MiB"}}]})),
    ("nested.yaml", "lmkv:\n  chunk_size: 128\n  tiers: [{type: cpu, options: "
                    "{max_bytes: 64MiB}}]\n"),
])
def test_file_formats(tmp_path: Path, name: str, text: str) -> None:
    config = load_config(write(tmp_path, name, text), env={})
    assert config.chunk_size == 128
    assert config.tiers[0].options == {"max_bytes": "64MiB"}


def test_precedence_file_env_dotted(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "chunk_size: 128\nlazy_offload_threshold: 5\n")
    env = {"LMKV_CHUNK_SIZE": "64", "LMKV_LAZY_OFFLOAD": "true",
           "LMKV_TIERS__0__OPTIONS__MAX_BYTES": "32MiB"}
    config = load_config(path, env=env, overrides={"lmkv.chunk_size": 32})
    assert config.chunk_size == 32  # dotted beats env beats file
    assert config.lazy_offload is True
    assert config.lazy_offload_threshold == 5
    assert config.tiers[0].options["max_bytes"] == "32MiB"


def test_config_file_from_dotted_key_and_env(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "chunk_size: 512\n")
    assert load_config(env={}, overrides={"lmkv.config_file": str(path)}).chunk_size == 512
    assert load_config(env={"LMKV_CONFIG": str(path)}).chunk_size == 512


def test_dotted_keys_append_tiers_and_pick_plugins() -> None:
    config = load_config(env={}, overrides={
        "lmkv.tiers.0.eviction": "lru", "lmkv.serializer.type": "naive",
        "lmkv.gpu_connector": "paged",
        "lmkv.lazy_offload_policy": {"type": "FIFO_MAX_AGE", "options": {"max_age_s": 5}},
    })
    assert config.gpu_connector.type == "paged"
    assert config.lazy_offload_policy.options == {"max_age_s": 5}
    dump = config.resolved_dump()
    assert dump["tiers"][0]["options"]["max_bytes"] == 4 << 30
    assert dump["lazy_offload_policy"]["options"] == {"max_age_s": 5.0}


# Each bad input gives exactly one line that names the key (and value when there is one).
BAD = [
    ({"lmkv.chunk_size": 0}, "config key 'chunk_size' = 0 (from lmkv.chunk_size): "
                             "must be a positive integer"),
    ({"lmkv.chunk_size": "lots"}, "config key 'chunk_size' = 'lots' (from lmkv.chunk_size): "
                                  "must be an integer"),
    ({"lmkv.lazy_offload_threshold": -3}, "config key 'lazy_offload_threshold' = -3"),
    ({"lmkv.lazy_offload_select_count": 1.5}, "config key 'lazy_offload_select_count' = 1.5"),
    ({"lmkv.lazy_offload": "maybe"}, "config key 'lazy_offload' = 'maybe' "
                                     "(from lmkv.lazy_offload): must be true or false"),
    ({"lmkv.lazy_offload_policy": "LIFO"}, "lazy_offload_policy.type = 'LIFO': unknown offload "
                                           "policy 'LIFO'; did you mean 'FIFO'? available: FIFO"),
    ({"lmkv.chunk_sise": 3}, "config key 'chunk_sise' (from lmkv.chunk_sise): unknown key"),
    ({"lmkv.tiers.0.type": "nosuch"}, "tiers.0.type = 'nosuch': unknown storage backend "
                                      "'nosuch'; available: cpu"),
    ({"lmkv.tiers.0.options.max_bytes": "a lot"},
     "config key 'tiers.0.options.max_bytes' = 'a lot' (from lmkv.tiers.0.options.max_bytes):"
     " must be a byte count or a number"),
    ({"lmkv.tiers.0.options.max_bytes": 0}, "config key 'tiers.0.options.max_bytes' = 0"),
    ({"lmkv.tiers.0.options.max_byte": 5}, "config key 'tiers.0.options.max_byte' "
                                           "(from lmkv.tiers.0.options.max_byte): unknown key"),
    ({"lmkv.chunk_size": True}, "config key 'chunk_size' = True (from lmkv.chunk_size): "
                                "must be an integer"),
    ({"lmkv.chunk_size": 2.0}, "config key 'chunk_size' = 2.0"),
    ({"lmkv.tiers.0.eviction": "mru"}, "tiers.0.eviction.type = 'mru': unknown eviction policy"),
    ({"lmkv.serializer": "pickle"}, "serializer.type = 'pickle': unknown serializer 'pickle'; "
                                    "available: int8, naive, zstd"),
    ({"lmkv.gpu_connector": {"type": "paged", "options": {"layout": "hnd"}}},
     "config key 'gpu_connector.options.layout' = 'hnd' (from lmkv.gpu_connector): input "
     "should be 'auto', 'flash', 'flashinfer', 'cpu' or 'mla'"),
    ({"lmkv.gpu_connector": {"type": "paged", "options": {"layuot": "cpu"}}},
     "config key 'gpu_connector.options.layuot' (from lmkv.gpu_connector): unknown key; "
     "did you mean 'layout'? allowed: kernels, layout"),
    ({"lmkv.tiers": []}, "config key 'tiers' = [] (from lmkv.tiers): list should have at least"),
    ({"lmkv.tiers.3.type": "cpu"}, "config key 'tiers.3.type' (from lmkv.tiers.3.type): "
                                   "index 3 skips entries"),
    ({"lmkv.model_name": ""}, "config key 'model_name' = ''"),
]


@pytest.mark.parametrize("overrides,expected", BAD)
def test_bad_values_give_one_line(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert expected in message


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_LAZY_OFFLOAD_THRESHOLD": "0"})
    assert str(info.value) == ("config key 'lazy_offload_threshold' = 0 (from env "
                               "LMKV_LAZY_OFFLOAD_THRESHOLD): must be a positive integer")


def test_env_values_are_json_or_text() -> None:
    config = load_config(env={"LMKV_MODEL_NAME": "123", "LMKV_CHUNK_SIZE": "64",
                              "LMKV_SAVE_PARTIAL_CHUNK": "true"})
    assert (config.model_name, config.chunk_size, config.save_partial_chunk) == ("123", 64, True)
    assert load_config(env={"LMKV_MODEL_NAME": "null"}).model_name == "null"
    with pytest.raises(ConfigError, match="'chunk_size' = True"):
        load_config(env={"LMKV_CHUNK_SIZE": "true"})


def test_dotted_string_values_read_like_env_values() -> None:
    assert load_config(env={}, overrides={"lmkv.chunk_size": "512"}).chunk_size == 512


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"chunk_size: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path, env={})


def test_unknown_env_var_is_an_error() -> None:
    with pytest.raises(ConfigError, match="'chunksize' \\(from env LMKV_CHUNKSIZE\\): unknown"):
        load_config(env={"LMKV_CHUNKSIZE": "12"})


def test_several_bad_values_give_a_line_each(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "chunk_size: -1\nlazy_offload_select_count: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert all(f"(from {path})" in line for line in lines)


@pytest.mark.parametrize("name,text,expected", [
    ("c.yaml", "chunk_size: [1\n", "not valid YAML"),
    ("c.toml", "chunk_size = = 1\n", "not valid TOML"),
    ("c.json", "{chunk_size: 1}", "not valid JSON"),
    ("c.ini", "chunk_size=1", "unknown format '.ini'; allowed: .yaml, .yml, .toml, .json"),
    ("c.yaml", "- 1\n- 2\n", "top level must be a mapping"),
])
def test_bad_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, name, text), env={})
    assert expected in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config("/nonexistent/lmkv.yaml", env={})


@pytest.mark.slow  # the lmkv command in a process
def test_cli_config_check(tmp_path: Path) -> None:
    good = write(tmp_path, "good.yaml", "chunk_size: 128\n")
    result = run_cli("config", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert "chunk_size: 128" in result.stdout
    assert "max_bytes: 4294967296" in result.stdout

    bad = write(tmp_path, "bad.yaml", "chunk_size: 128\nlazy_offload_threshold: 0\n")
    result = run_cli("config", "check", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"lmkv: error: config key 'lazy_offload_threshold' = 0 (from {bad}): "
        "must be a positive integer"]


def test_lookup_section() -> None:
    config = load_config(env={"LMKV_LOOKUP__TRANSPORT": "tcp", "LMKV_LOOKUP__BASE_PORT": "7000"})
    assert (config.lookup.transport, config.lookup.base_port, config.lookup.timeout_ms) == (
        "tcp", 7000, 3000)
    with pytest.raises(ConfigError, match="transport 'tcp' needs base_port"):
        load_config(env={}, overrides={"lmkv.lookup.transport": "tcp"})
    with pytest.raises(ConfigError, match=r"config key 'lookup\.timeout_ms' = 0"):
        load_config(env={}, overrides={"lmkv.lookup.timeout_ms": 0})
    with pytest.raises(ConfigError, match=r"config key 'lookup\.transport' = 'udp'"):
        load_config(env={}, overrides={"lmkv.lookup.transport": "udp"})


LAUGHS = """\
tiers:
  - type: fs
    options:
      url: /tmp/lmkv-laughs
      storage_options:
        a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
        b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
        c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
        d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
        e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
        f: [*e,*e,*e,*e,*e,*e,*e,*e,*e]
"""


def test_yaml_anchors_are_refused_with_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "laughs.yaml", LAUGHS)
    result = run_cli("config", "check", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"lmkv: error: config file {path}: line 6: anchors and aliases (&a, *a) are not "
        "allowed; write the value out"]


@pytest.mark.parametrize("name,text,expected", [
    ("c.yaml", "chunk_size: 128\nchunk_size: 256\n", "line 2: duplicate key 'chunk_size'"),
    ("c.yaml", "tiers:\n  - type: cpu\n    options: {max_bytes: 1GiB, max_bytes: 2GiB}\n",
     "line 3: duplicate key 'max_bytes'"),
    ("c.json", '{"chunk_size": 128, "chunk_size": 256}', "duplicate key 'chunk_size'"),
    ("c.toml", "chunk_size = 1\nchunk_size = 2\n", "not valid TOML"),
    ("c.yaml", "x: *nowhere\n", "line 1: anchors and aliases"),
])
def test_duplicate_keys_are_refused(tmp_path: Path, name: str, text: str,
                                    expected: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"config file {path}: ")
    assert expected in str(info.value)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("name,text", [
    ("c.yaml", ""), ("c.yaml", "# only a comment\n"), ("c.yaml", "lmkv:\n"),
    ("c.toml", ""), ("c.json", "{}"), ("c.yml", "{}\n"),
])
def test_empty_config_file_is_refused(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith(f"config file {path}: ") and "empty" in message
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize("overrides,expected", [
    ({"lmkv.chunksize": 1}, "config key 'chunksize' (from lmkv.chunksize): unknown key; did you "
                            "mean 'chunk_size'? allowed: async_load, block_size, chunk_size, "
                            "gpu_connector,"),
    ({"lmkv.lookup.timeout": 1}, "config key 'lookup.timeout' (from lmkv.lookup.timeout): "
                                 "unknown key; did you mean 'timeout_ms'? allowed: backoff_ms, "
                                 "base_port, curve, host, insecure, max_tokens, runtime_dir, "
                                 "timeout_ms, transport"),
    ({"lmkv.tiers.0.eviction.opts": 1}, "unknown key; did you mean 'options'? allowed: "
                                        "options, type"),
    ({"lmkv.tiers.0.options.max_byte": 1}, "config key 'tiers.0.options.max_byte' (from "
                                           "lmkv.tiers.0.options.max_byte): unknown key; did "
                                           "you mean 'max_bytes'? allowed: allow_overcommit, "
                                           "huge_pages, max_bytes, pin_memory, prefault_ahead, "
                                           "shared_memory"),
    ({"lmkv.tiers.0": {"type": "redis", "options": {"part_byte": 1}}},
     "did you mean 'part_bytes'? allowed: close_timeout_s, cluster,"),
    ({"lmkv.zzz": 1}, "config key 'zzz' (from lmkv.zzz): unknown key; allowed: async_load,"),
])
def test_unknown_keys_list_the_allowed_ones(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    assert len(str(info.value).splitlines()) == 1
    assert expected in str(info.value)


RESERVED = ("the LMKV_ prefix is reserved for lmkv: every LMKV_* variable is a config key or "
            "one of LMKV_CONFIG, LMKV_DISABLE_PLUGINS, LMKV_KERNELS, LMKV_LOAD_PLUGINS, "
            "LMKV_LOG_LEVEL")


@pytest.mark.parametrize("env,expected", [
    ({"LMKV_CHUNKSIZE": "1"}, "(from env LMKV_CHUNKSIZE): unknown key; did you mean "
                              "LMKV_CHUNK_SIZE?"),
    ({"LMKV_CONFIGG": "c.yaml"}, "did you mean LMKV_CONFIG?"),
    # A plugin's own variable under lmkv's prefix: named, and the reservation said.
    ({"LMKV_HELLO_GREETING": "hi"}, "config key 'hello_greeting' (from env "
                                    "LMKV_HELLO_GREETING): unknown key; allowed: async_load,"),
    ({"LMKV_HELLO__GREETING": "hi"}, "config key 'hello' (from env LMKV_HELLO__GREETING): "
                                     "unknown key; allowed: async_load,"),
])
def test_unknown_env_var_is_named_with_the_reservation(env: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert expected in message
    assert message.endswith(RESERVED)


def test_unknown_nested_env_var_suggests_a_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_TIERS__0__OPTIONS__MAX_BYTEZ": "1GiB"})
    assert str(info.value) == (
        "config key 'tiers.0.options.max_bytez' (from env LMKV_TIERS__0__OPTIONS__MAX_BYTEZ): "
        "unknown key; did you mean LMKV_TIERS__0__OPTIONS__MAX_BYTES? allowed: "
        "allow_overcommit, huge_pages, max_bytes, pin_memory, prefault_ahead, shared_memory")


README_STYLE = """\
serializer: naive
tiers:
  - cpu
  - type: fs
    options: {url: /tmp/lmkv-env-bare}
    eviction: lru
lazy_offload_policy: FIFO
"""


@pytest.mark.parametrize("env,overrides,check", [
    ({"LMKV_SERIALIZER__TYPE": "zstd"}, {}, lambda c: c.serializer.type == "zstd"),
    ({"LMKV_SERIALIZER__TYPE": "zstd", "LMKV_SERIALIZER__OPTIONS__LEVEL": "3"}, {},
     lambda c: (c.serializer.type, c.serializer.options) == ("zstd", {"level": 3})),
    ({"LMKV_TIERS__1__EVICTION__TYPE": "LRU"}, {}, lambda c: c.tiers[1].eviction.type == "LRU"),
    ({"LMKV_TIERS__0__OPTIONS__MAX_BYTES": "1GiB"}, {},
     lambda c: (c.tiers[0].type, c.tiers[0].options) == ("cpu", {"max_bytes": "1GiB"})),
    ({}, {"lmkv.serializer.type": "zstd"}, lambda c: c.serializer.type == "zstd"),
    ({}, {"lmkv.lazy_offload_policy.type": "FIFO_MAX_AGE"},
     lambda c: c.lazy_offload_policy.type == "FIFO_MAX_AGE"),
])
def test_nested_overrides_reach_into_bare_plugin_names(tmp_path: Path, env: dict,
                                                       overrides: dict, check) -> None:
    config = load_config(write(tmp_path, "c.yaml", README_STYLE), env=env, overrides=overrides)
    assert check(config)


def test_nested_override_inside_a_plain_value_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_CHUNK_SIZE__X": "1"})
    assert str(info.value) == ("config key 'chunk_size.x' (from env LMKV_CHUNK_SIZE__X): "
                               "cannot set 'x' inside a value of type int")


def test_plugin_without_options_says_so() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMKV_SERIALIZER__OPTIONS__LEVEL": "3"})
    assert str(info.value).endswith("unknown key; this takes no keys (allowed: none)")


def test_model_at_follows_sections_and_list_items() -> None:
    from lmkv.config.model import LookupConfig, PluginRef, TierConfig
    from lmkv.config.suggestions import model_at

    assert model_at(LMKVConfig, ["tiers", "0"]) is TierConfig
    assert model_at(LMKVConfig, ["tiers"]) is None  # a list, not one tier
    assert model_at(LMKVConfig, ["tiers", "0", "eviction"]) is PluginRef
    assert model_at(LMKVConfig, ["lookup"]) is LookupConfig
    assert model_at(LMKVConfig, ["lookup", "0"]) is None
    assert model_at(LMKVConfig, ["tiers", "0", "options"]) is None  # free-form until resolved


@pytest.mark.parametrize("source,where", [
    ("file", "c.yaml"), ("env", "from env LMKV_SERVER__TRANSPORT"),
    ("dotted", "from lmkv.server.transport")])
def test_the_old_server_transport_key_names_its_new_name(tmp_path: Path, source: str,
                                                         where: str) -> None:
    """``server.transport`` became ``server.data_path`` (``frame`` became ``inline``):
    one line that says so and lists the values, wherever the old key comes from."""
    kwargs: dict = {"env": {}}
    if source == "file":
        kwargs["path"] = write(tmp_path, "c.yaml", "server:\n  transport: frame\n")
    elif source == "env":
        kwargs["env"] = {"LMKV_SERVER__TRANSPORT": "frame"}
    else:
        kwargs["overrides"] = {"lmkv.server.transport": "frame"}
    with pytest.raises(ConfigError) as exc:
        load_config(**kwargs)
    message = str(exc.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("config key 'server.transport'") and where in message
    assert message.endswith("was renamed 'server.data_path'; allowed values: auto, inline")


def test_the_data_path_takes_auto_and_inline() -> None:
    assert load_config(env={}).server.data_path == "auto"
    assert load_config(env={"LMKV_SERVER__DATA_PATH": "inline"}).server.data_path == "inline"
    with pytest.raises(ConfigError, match=r"'server\.data_path' = 'frame'"):
        load_config(env={"LMKV_SERVER__DATA_PATH": "frame"})


def test_block_size_must_divide_chunk_size() -> None:
    with pytest.raises(ConfigError, match="block_size 48 must divide chunk_size 256"):
        load_config(env={}, overrides={"lmkv.block_size": 48})
    assert load_config(env={}, overrides={"lmkv.block_size": 64}).block_size == 64
