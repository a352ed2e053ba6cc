"""lmkv.config.lmcache: LMCache's options, what each becomes in lmkv, and docs/vllm.md's
table generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.lmcache import (
    OPTIONS,
    TABLE_BEGIN,
    TABLE_END,
    find_option,
    markdown_table,
    size_text,
    translate,
)
from lmkv.config.model import load_config
from tests.conftest import REPO


# LMCache v1 options (lmcache/v1/config.py) and old names it still maps: each must be
# known, so none falls through to "not an LMCache option lmkv knows of".
def _words(text: str) -> list[str]:
    return text.split()


LMCACHE_OPTIONS = _words("""
chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size
local_disk local_disk_path_sharding max_local_disk_size remote_url remote_serde
use_layerwise save_decode_cache pre_caching_hash_algorithm enable_blending
blend_recompute_ratios blend_thresholds blend_check_layers blend_min_tokens
blend_special_str retrieve_locations store_location enable_p2p p2p_host p2p_init_ports
p2p_lookup_ports mp_host mp_port enable_controller lmcache_instance_id controller_pull_url
controller_reply_url lmcache_worker_ports lmcache_worker_ids
lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time enable_pd pd_role
pd_buffer_size pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port
pd_proxy_host pd_proxy_port transfer_channel nixl_backends nixl_buffer_size
nixl_buffer_device gds_path gds_path_sharding cufile_buffer_size maru_path maru_pool_size
use_gds audit_actual_remote_url internal_api_server_host extra_config save_unfull_chunk
save_full_chunk_in_decode blocking_timeout_secs external_lookup_client py_enable_gc
cache_policy numa_mode enable_async_loading internal_api_server_enabled
internal_api_server_port_start priority_limit internal_api_server_include_index_list
runtime_plugin_locations storage_plugins remote_storage_plugins lookup_timeout_ms
min_retrieve_tokens hit_miss_ratio lookup_server_worker_ids enable_scheduler_bypass_lookup
script_allowed_imports enable_lazy_memory_allocator lazy_memory_initial_ratio
enable_chunk_statistics chunk_statistics_strategy enable_kv_events use_gpu_connector_v3
pin_timeout_sec pin_check_interval_sec remote_config_url app_id enable_hidden_state_cache
store_async enable_sparse_attention dsa_two_groups enable_shared_cpu_cache remote_fill_x
enable_xpyd nixl_peer_host controller_url lmcache_worker_port plugin_locations
external_backends enable_nixl nixl_role lookup_url distributed_url weka_path error_handling
""")


@pytest.mark.parametrize("name", LMCACHE_OPTIONS)
def test_every_lmcache_option_is_known(name: str) -> None:
    option = find_option(name)
    assert option is not None, name
    assert option.how, name


def test_mp_keys_exist_only_in_the_extra_config() -> None:
    assert find_option("mp.lazy_offload") is None
    option = find_option("mp.lazy_offload", extra=True)
    assert option is not None and option.key == "lazy_offload"
    assert find_option("mp.no_such_key", extra=True) is None


def test_no_name_is_listed_twice() -> None:
    names = [name for option in OPTIONS for name in option.names]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("gib", "text"), [(5, "5GiB"), (5.0, "5GiB"), (0.5, "512MiB"),
                                          (2.5, "2560MiB"), (1 / 1024 ** 2, "1KiB")])
def test_lmcache_gb_are_gib(gib: float, text: str) -> None:
    assert size_text(gib) == text


def test_tiers_from_the_storage_options() -> None:
    result = translate({"max_local_cpu_size": 8, "local_disk": "file:///data/kv/",
                        "max_local_disk_size": "100", "remote_url": "redis://cache:6379",
                        "cache_policy": "LFU", "local_cpu_use_hugepages": "true"})
    assert result.settings["tiers"] == [
        {"type": "cpu", "options": {"max_bytes": "8GiB", "huge_pages": True},
         "eviction": "lfu"},
        {"type": "fs", "options": {"url": "/data/kv/", "max_bytes": "100GiB"},
         "eviction": "lfu"},
        {"type": "redis", "options": {"url": "redis://cache:6379"}, "eviction": "lfu"}]
    assert result.dropped == []


def test_lmcache_defaults_make_a_5gib_cpu_tier() -> None:
    assert translate({}).settings == {"tiers": [{"type": "cpu",
                                                 "options": {"max_bytes": "5GiB"}}]}


def test_s3_remote_is_an_fs_tier_and_lm_is_not_carried() -> None:
    assert translate({"remote_url": "s3://bucket/kv"}).settings["tiers"][1] == \
        {"type": "fs", "options": {"url": "s3://bucket/kv"}}
    dropped = dict(translate({"remote_url": "lm://host:65432"}).dropped)
    assert "lmkv server" in dropped["remote_url"]
    assert "memcache://" in dict(translate({"remote_url": "memcache://h:1"})
                                 .dropped)["remote_url"]


def test_mooncakestore_is_a_mooncake_tier_with_the_connectors_extra_config() -> None:
    result = translate({"remote_url": "mooncakestore://10.0.0.1:50051/?device=mlx5_0",
                        "extra_config": {"master_server_address": "10.9.9.9:1",
                                         "metadata_server": "http://10.0.0.1:8080/metadata",
                                         "local_hostname": "10.0.0.2", "protocol": "rdma",
                                         "local_buffer_size": 536870912,
                                         "transfer_timeout": 2, "storage_root_dir": "/ssd",
                                         "prefer_local_alloc": True, "mystery": 1}})
    assert result.settings["tiers"][1] == {"type": "mooncake", "options": {
        "master_address": "10.0.0.1:50051",  # the URL's, as LMCache's connector takes it
        "metadata_server": "http://10.0.0.1:8080/metadata", "local_hostname": "10.0.0.2",
        "protocol": "rdma", "device_name": "mlx5_0",
        "global_segment_size": "3200MiB",  # LMCache's default: unset, as LMCache runs it
        "local_buffer_size": "512MiB", "call_timeout_s": 2}}
    assert sorted(name for name, _ in result.dropped) == [
        "extra_config.mystery", "extra_config.prefer_local_alloc",
        "extra_config.storage_root_dir"]


def test_mooncakestore_extra_config_from_the_variable_and_bad_values() -> None:
    result = translate({"remote_url": "mooncakestore://",
                        "extra_config": '{"master_server_address": "m:7", '
                                        '"global_segment_size": "lots", "protocol": 3}'})
    assert result.settings["tiers"][1]["options"] == {
        "master_address": "m:7", "global_segment_size": "3200MiB", "local_buffer_size": "1GiB"}
    dropped = dict(result.dropped)
    assert "'lots' is not a number of bytes" in dropped["extra_config.global_segment_size"]
    assert "3 is not text" in dropped["extra_config.protocol"]
    assert "reads them for a mooncakestore:// remote_url only" in dict(
        translate({"remote_url": "redis://h:1", "extra_config": {"a": 1}}).dropped
    )["extra_config"]
    with pytest.raises(ConfigError, match="must be a mapping"):
        translate({"extra_config": "[1, 2]"})


def test_a_disk_without_a_size_is_reported() -> None:
    result = translate({"local_disk": "/data/kv"})
    assert result.settings["tiers"][1] == {"type": "fs", "options": {"url": "/data/kv"}}
    assert "no budget" in dict(result.dropped)["max_local_disk_size"]


def test_keys_carry_over_with_their_values() -> None:
    result = translate({"chunk_size": "512", "enable_async_loading": True,
                        "lookup_timeout_ms": 500, "remote_serde": "naive"}, tiers=False)
    assert result.settings == {"chunk_size": 512, "async_load": True,
                               "lookup.timeout_ms": 500, "serializer": "naive"}
    assert result.nested()["lookup"] == {"timeout_ms": 500}


@pytest.mark.parametrize(("values", "name", "why"), [
    ({"enable_blending": True}, "enable_blending", "CacheBlend"),
    ({"enable_pd": True, "pd_role": "sender"}, "pd_role", "NixlConnector"),
    ({"remote_serde": "cachegen"}, "remote_serde", "int8"),
    ({"cache_policy": "MRU"}, "cache_policy", "lru, lfu, arc, s3fifo"),
    ({"local_cpu": False}, "local_cpu", "memory tier"),
    ({"brand_new_option": 1}, "brand_new_option", "not an LMCache option"),
])
def test_options_without_an_equivalent_are_dropped_with_the_reason(
        values: dict[str, object], name: str, why: str) -> None:
    dropped = dict(translate(values).dropped)
    assert why in dropped[name]


def test_null_and_features_left_off_ask_for_nothing() -> None:
    result = translate({"remote_url": None, "local_disk": None, "enable_blending": False,
                        "enable_p2p": "false", "blend_check_layers": [], "pd_role": None},
                       tiers=False)
    assert result.dropped == [] and result.errors == []
    assert result.settings == {}


def test_a_familys_settings_are_moot_while_its_switch_is_off() -> None:
    assert translate({"blend_min_tokens": 256, "pd_role": "sender"}).dropped == []
    dropped = dict(translate({"enable_blending": "true", "blend_min_tokens": 256}).dropped)
    assert set(dropped) == {"enable_blending", "blend_min_tokens"}
    # vLLM's extra config answers every lmcache.* key it is given
    assert translate({"blend_min_tokens": 256}, extra=True).dropped != []


def test_lmkvs_behaviour_already_is_carried_not_dropped() -> None:
    result = translate({"save_unfull_chunk": False,
                        "error_handling": True}, tiers=False)
    assert result.dropped == [] and result.settings == {}


@pytest.mark.parametrize(("values", "expect"), [
    ({"chunk_size": "abc"}, "'chunk_size' = 'abc': must be a positive integer"),
    ({"chunk_size": 0}, "must be a positive integer"),
    ({"chunk_size": True}, "must be a positive integer"),
    ({"enable_async_loading": "maybe"}, "must be true or false"),
    ({"max_local_cpu_size": "lots"}, "number of GB"),
    ({"max_local_cpu_size": -1}, "at least 0"),
    ({"local_disk": 5}, "non-empty text"),
])
def test_a_value_of_the_wrong_type_is_one_line(values: dict[str, object], expect: str
                                                ) -> None:
    with pytest.raises(ConfigError) as info:
        translate(values)
    assert expect in str(info.value) and "\n" not in str(info.value)


def test_the_translation_loads_in_lmkv(tmp_path: Path) -> None:
    result = translate({"chunk_size": 128, "max_local_cpu_size": 0.0625,
                        "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 1,
                        "enable_async_loading": True, "cache_policy": "LFU"})
    config = load_config(overrides=result.settings, env={})
    assert (config.chunk_size, config.async_load) == (128, True)
    assert [t.type for t in config.tiers] == ["cpu", "fs"]
    assert config.tiers[0].eviction.type == "lfu"


def test_docs_table_is_the_mapping() -> None:
    text = (REPO / "docs" / "vllm.md").read_text(encoding="utf-8")
    assert TABLE_BEGIN in text and TABLE_END in text, "docs/vllm.md lost its table markers"
    table = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN):text.index(TABLE_END)].strip()
    assert table == markdown_table(), \
        "docs/vllm.md's LMCache table differs from lmkv/config/lmcache.py; regenerate it: " \
        "python -m lmkv.config.lmcache docs/vllm.md"


@pytest.mark.parametrize(("extra", "expect"), [
    ({"lmcache.no_such_option": None},
     "key 'lmcache.no_such_option': lmkv does not read it: not an LMCache option"),
    ({"lmcache.no_such_option": 3},
     "key 'lmcache.no_such_option': lmkv does not read it: not an LMCache option"),
    ({"lmcache.max_local_cpu_size": None},
     "'lmcache.max_local_cpu_size': lmkv does not read LMCache's storage keys; "
     "set \"lmkv.tiers\" instead"),
    ({"lmcache.local_disk": None, "lmcache.max_local_disk_size": None},
     "set \"lmkv.tiers\" instead"),
    ({"lmcache.max_local_cpu_size": 5},
     "set \"lmkv.tiers\": [{\"type\": \"cpu\", \"options\": {\"max_bytes\": \"5GiB\"}}] instead"),
])
def test_an_extra_config_key_lmkv_does_not_read_is_one_line_null_or_not(
        extra: dict[str, object], expect: str) -> None:
    """LMCache reads null as its default, but lmkv reads none of these keys: a null
    unknown or storage key is refused like any other, never dropped or a traceback."""
    from lmkv.integrations.vllm.config import config_from_extra
    with pytest.raises(ConfigError) as info:
        config_from_extra(extra)
    assert expect in str(info.value) and "\n" not in str(info.value).strip()
