"""LMCache's configuration options and what each becomes in lmkv.

The one table that ``lmkv migrate``, the vLLM connector's ``lmcache.*`` extra-config
keys and docs/vllm.md's migration table all read, so the three never disagree.

An LMCache option has three spellings: a YAML key in its config file
(``max_local_cpu_size``), an environment variable (``LMCACHE_MAX_LOCAL_CPU_SIZE``)
and a dotted key in vLLM's ``kv_connector_extra_config``
(``lmcache.max_local_cpu_size``). The multi-process connector's keys
(``lmcache.mp.*``) exist in the last form only. Each option either carries over
(an lmkv key, converted where the units differ: LMCache's sizes are numbers of
GiB it calls "GB"), is what lmkv does anyway, or has no lmkv equivalent, with the
reason. Names are LMCache's as of its v1 config (``lmcache/v1/config.py``);
families (``pd_*``) cover the options of one feature, old and new names alike.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lmkv.base.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
EXTRA_PREFIX = "lmcache."
#: LMCache's ``LMCACHE_CONFIG_FILE``: the file it reads (``lmkv migrate`` does too).
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
#: LMCache's defaults that shape the tiers ``lmkv migrate`` writes.
DEFAULT_CPU_GIB = 5.0
#: The cpu tier's least ``max_bytes``.
MIN_CPU_BYTES = 4096

Kind = Literal["key", "same", "tiers", "none"]


class NotCarried(Exception):
    """This value of an option has no lmkv equivalent (the message says why)."""


#: What a parser returns for a value that needs no lmkv key (``store_decode: false``
#: where this lmkv has no such key: it stores prompts only anyway).
NOTHING_TO_SET = object()


Parse = Callable[[Any], Any]


@dataclass(frozen=True)
class LMCacheOption:
    """One LMCache option (or a family of them) and its lmkv counterpart.

    ``kind``: ``key`` sets the lmkv key ``key`` to ``parse(value)``; ``same`` is
    lmkv's behaviour already (nothing to set); ``tiers`` shapes lmkv's ``tiers``
    list; ``none`` has no equivalent (``how`` says why). ``parse`` checks the value
    as LMCache types it (strings as its env vars spell them) and converts it;
    a ValueError says what is allowed, a NotCarried that this value has no
    equivalent. ``names`` ending in ``*`` stand for every name with that prefix;
    ``extra_only``: only a ``kv_connector_extra_config`` key (``lmcache.mp.*``);
    ``switch``: the option that turns the family on (its other options are moot,
    and not reported, while it is off).
    """

    names: tuple[str, ...]
    kind: Kind
    lmkv: str
    how: str
    key: str | None = None
    parse: Parse | None = None
    extra_only: bool = False
    switch: str | None = None


# -- value parsers: LMCache's types, strings accepted as its env converters take them --

def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError("must be true or false")


def _positive_int(value: Any) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError("must be a positive integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _gib(value: Any) -> float:
    """A size in LMCache's "GB" (it multiplies by 1024**3: GiB)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError("must be a number of GB (e.g. 5 or 2.5)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError("must be a number of GB (e.g. 5 or 2.5), at least 0")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be non-empty text")
    return value.strip()


def _policy(value: Any) -> Any:
    """An offload policy: a name, or lmkv's ``{type, options}`` (lmkv validates it)."""
    return value if isinstance(value, dict) else _text(value)


def _store_decode(value: Any) -> bool:
    return _bool(value)


def _remote_serde(value: Any) -> str:
    name = _text(value)
    if name != "naive":
        raise NotCarried(f"lmkv has no {name!r} codec; its serializers are naive, zstd "
                         "(lossless) and int8 (lossy), docs/serializers.md")
    return name


def _local_disk(value: Any) -> str:
    path = _text(value)
    return path[len("file://"):] if path.startswith("file://") else path


def _mapping(value: Any) -> dict[str, Any]:
    """A mapping, or (``LMCACHE_EXTRA_CONFIG``) a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("must be a mapping (a JSON object in the variable)") from None
    if not isinstance(value, dict):
        raise ValueError("must be a mapping (a JSON object in the variable)")
    return value


_TIER_PARSERS: dict[str, Parse] = {
    "local_cpu": _bool, "max_local_cpu_size": _gib, "local_cpu_use_hugepages": _bool,
    "local_disk": _local_disk, "max_local_disk_size": _gib, "remote_url": _text,
    "cache_policy": _text, "extra_config": _mapping,
}

_UNKNOWN = "not an LMCache option lmkv knows of; lmkv has no equivalent"


def _none(names: tuple[str, ...], how: str, *, extra_only: bool = False,
          switch: str | None = None) -> LMCacheOption:
    return LMCacheOption(names, "none", "", how, extra_only=extra_only, switch=switch)


OPTIONS: tuple[LMCacheOption, ...] = (
    # -- carried over as an lmkv key ---------------------------------------------------
    LMCacheOption(("chunk_size",), "key", "`chunk_size`", "tokens per chunk, as in LMCache",
                  key="chunk_size", parse=_positive_int),
    LMCacheOption(("enable_async_loading",), "key", "`async_load`",
                  "loads run beside other requests' steps", key="async_load", parse=_bool),
    LMCacheOption(("use_layerwise",), "key", "`layerwise`",
                  "loads and stores run layer by layer beside the forward (vLLM)",
                  key="layerwise", parse=_bool),
    LMCacheOption(("lookup_timeout_ms",), "key", "`lookup.timeout_ms`",
                  "a lookup not answered in time is a miss", key="lookup.timeout_ms",
                  parse=_positive_int),
    LMCacheOption(("save_decode_cache", "save_full_chunk_in_decode"), "key", "`store_decode`",
                  "store the whole chunks computed during decode", key="store_decode",
                  parse=_store_decode),
    LMCacheOption(("remote_serde",), "key", "`serializer`",
                  "`naive` is lmkv's default; `cachegen` and others: none (lmkv's lossy "
                  "serializer is `int8`)", key="serializer", parse=_remote_serde),
    LMCacheOption(("mp.lazy_offload",), "key", "`lazy_offload`", "same meaning",
                  key="lazy_offload", parse=_bool, extra_only=True),
    LMCacheOption(("mp.lazy_offload_policy",), "key", "`lazy_offload_policy`",
                  "`FIFO`, `FIFO_MAX_AGE`", key="lazy_offload_policy", parse=_policy,
                  extra_only=True),
    LMCacheOption(("mp.lazy_offload_threshold",), "key", "`lazy_offload_threshold`",
                  "same meaning", key="lazy_offload_threshold", parse=_positive_int,
                  extra_only=True),
    LMCacheOption(("mp.lazy_offload_select_count",), "key", "`lazy_offload_select_count`",
                  "same meaning", key="lazy_offload_select_count", parse=_positive_int,
                  extra_only=True),
    # -- the tiers ---------------------------------------------------------------------
    LMCacheOption(("local_cpu",), "tiers", "`tiers.0`: a `cpu` tier",
                  "`true`: lmkv's first tier is a cpu tier; `false`: none (lmkv keeps its "
                  "memory tier; LMCache allocates `max_local_cpu_size` as staging even so)"),
    LMCacheOption(("max_local_cpu_size",), "tiers", "`tiers.0.options.max_bytes`",
                  "GB (LMCache's are GiB) to a size: `5` -> `5GiB`; LMCache's default 5 "
                  "when unset"),
    LMCacheOption(("local_cpu_use_hugepages",), "tiers", "`tiers.0.options.huge_pages`",
                  "same meaning"),
    LMCacheOption(("local_disk", "max_local_disk_size"), "tiers",
                  "an `fs` tier: `{type: fs, options: {url: PATH, max_bytes: SIZE}}`",
                  "`file://` dropped from the path; GB to GiB; size 0 or unset: no budget "
                  "(reported)"),
    LMCacheOption(("remote_url",), "tiers",
                  "`redis://`, `rediss://`, `unix://`: a `redis` tier (`pip install "
                  "lmkv-redis`); `mooncakestore://HOST:PORT`: a `mooncake` tier (`pip "
                  "install lmkv-mooncake`), its master; `s3://`: an `fs` tier",
                  "`?device=` of `mooncakestore://` is the tier's `device_name`; `lm://`: "
                  "none, an `lmkv server` instead (`mode: server`); other schemes: none"),
    LMCacheOption(("extra_config",), "tiers", "the `mooncake` tier's options",
                  "with a `mooncakestore://` remote_url: `master_server_address` (the URL's "
                  "wins), `metadata_server`, `local_hostname`, `protocol`, `device_name` "
                  "as named in lmkv, `global_segment_size` and `local_buffer_size` (bytes; "
                  "LMCache's defaults 3200MiB and 1GiB when unset), `transfer_timeout` to "
                  "`call_timeout_s`; `storage_root_dir`, `prefer_local_alloc` and other "
                  "remotes' settings: none"),
    LMCacheOption(("cache_policy",), "tiers", "`tiers.N.eviction`",
                  "`LRU`: `lru` (lmkv's default), `LFU`: `lfu`; `FIFO`, `MRU`: none (lmkv "
                  "has lru, lfu, arc, s3fifo)"),
    # -- what lmkv does anyway -----------------------------------------------------------
    LMCacheOption(("save_unfull_chunk",), "same", "nothing to set",
                  "lmkv stores a prompt's tail cut at vLLM's block and matches hits at the "
                  "block; `save_partial_chunk: true` also stores a tail of partial blocks",
                  parse=_bool),
    LMCacheOption(("error_handling",), "same", "nothing to set",
                  "always on: a fault is a miss and vLLM recomputes", parse=_bool),
    # -- no equivalent -------------------------------------------------------------------
    _none(("mp_host", "mp_port", "mp.host", "mp.port", "mp.server_urls"),
          "an `lmkv server` instead: `mode: server`, `server.address: tcp://HOST:PORT` "
          "(`lmkv server --host HOST --port PORT`)"),
    _none(("mp.mp_transfer_mode", "mp.heartbeat_interval", "mp.mq_timeout",
           "mp.deployment", "mp.checkpoint_identity"),
          "LMCache's multi-process transport; lmkv's server connection has "
          "`server.data_path` and `server.timeout_ms`", extra_only=True),
    _none(("mp.local_cpu_size_gb",),
          "the `lmkv server`'s own config sizes its cpu tier (`tiers.0.options.max_bytes`)",
          extra_only=True),
    _none(("store_async", "store_async_max_queue_size"),
          "stores reach the first tier within the step and lower tiers in the background "
          "(`write_through_queue_chunks`); `lazy_offload` takes stores off the step"),
    _none(("enable_blending", "blend_*"), "lmkv reuses prefixes only (no CacheBlend)",
          switch="enable_blending"),
    _none(("enable_p2p", "p2p_*", "lookup_url", "distributed_url", "transfer_channel"),
          "engines read each other's memory through the `peer` tier (docs/tiers/peer.md): add "
          "it to `tiers` with this instance's `listen` and the fleet's `peers`",
          switch="enable_p2p"),
    _none(("enable_pd", "pd_*", "enable_xpyd", "enable_nixl", "nixl_*"),
          "disaggregated prefill is a transport, not a cache: use vLLM's NixlConnector",
          switch="enable_pd"),
    _none(("enable_controller", "controller_*", "lmcache_instance_id", "lmcache_worker_*"),
          "no cache controller; `lmkv stats` shows an `lmkv server`'s figures",
          switch="enable_controller"),
    _none(("internal_api_server_*",), "no internal HTTP API",
          switch="internal_api_server_enabled"),
    _none(("use_gds", "gds_*", "cufile_buffer_size", "weka_path", "maru_*"),
          "no GPU Direct Storage or CXL tier; an `fs` tier on that directory reads "
          "through the page cache"),
    _none(("enable_shared_cpu_cache", "shared_cpu_*"),
          "an `lmkv server` shares its cpu tier with every engine on the machine "
          "(`mode: server`)", switch="enable_shared_cpu_cache"),
    _none(("runtime_plugin_locations", "plugin_locations", "storage_plugins",
           "remote_storage_plugins", "external_backends", "script_allowed_imports"),
          "lmkv plugins are installed packages found through entry points (`lmkv plugins`)"),
    _none(("enable_lazy_memory_allocator", "lazy_memory_*", "reserve_local_cpu_size",
           "numa_mode"),
          "the cpu tier's arena takes pages as chunks touch them (`prefault_ahead`); no "
          "NUMA placement or reserve"),
    _none(("local_disk_path_sharding",), "one `fs` tier per directory"),
    _none(("retrieve_locations", "store_location"),
          "stores go to the first tier and are written through; lookups ask the tiers in "
          "order"),
    _none(("external_lookup_client", "lookup_server_worker_ids",
           "enable_scheduler_bypass_lookup"),
          "the lookup channel is lmkv's own (`lookup.*`, docs/lookup.md)"),
    _none(("min_retrieve_tokens",), "every hit of whole blocks is loaded"),
    _none(("priority_limit",), "no per-request priority"),
    _none(("pre_caching_hash_algorithm",), "lmkv's chunk hash is fixed (docs/identity.md)"),
    _none(("pin_timeout_sec", "pin_check_interval_sec"),
          "a pin is released by the lookup that took it; no timeout to set"),
    _none(("blocking_timeout_secs",),
          "lmkv's remote tiers have their own timeouts (`server.timeout_ms`, the redis "
          "tier's `socket_timeout_s`)"),
    _none(("enable_kv_events",), "KV events go through vLLM's own `--kv-events-config`"),
    _none(("enable_chunk_statistics", "chunk_statistics_*", "hit_miss_ratio"),
          "`lmkv replay` measures hit ratios from a trace", switch="enable_chunk_statistics"),
    _none(("use_gpu_connector_v3",),
          "the `paged` connector reads the layout from vLLM's tensors"),
    _none(("enable_sparse_attention", "experimental_sampled_layerwise_lookup", "dsa_*",
           "enable_dsa_cold_compact_load", "save_indexer_only_first_rank",
           "decode_preemption_checkpoint", "enable_npu_*", "enable_remote_lmcache_store",
           "remote_fill_*"),
          "model- or hardware-specific LMCache paths (sparse attention, Ascend)"),
    _none(("enable_hidden_state_cache", "max_hidden_state_cpu_size", "hidden_state_layers",
           "hidden_states_retrieve_mode"), "lmkv caches KV only",
          switch="enable_hidden_state_cache"),
    _none(("remote_config_url", "app_id"),
          "no remote config service: a file, `LMKV_*` and `lmkv.*` keys"),
    _none(("py_enable_gc",), "lmkv leaves Python's garbage collector alone"),
    _none(("audit_actual_remote_url",), "no audit backend"),
    _none(("ec_*",), "LMCache backend-specific settings"),
)

#: ``LMCACHE_*`` variables that are not options: what becomes of each.
ENV_ONLY: dict[str, str] = {
    "LMCACHE_LOG_LEVEL": "set LMKV_LOG_LEVEL (or lmkv --log-level) instead",
    "LMCACHE_USE_EXPERIMENTAL": "lmkv has one implementation",
    "LMCACHE_TRACK_USAGE": "lmkv sends no usage data",
}


def _build_index() -> tuple[dict[str, LMCacheOption], list[tuple[str, LMCacheOption]]]:
    exact: dict[str, LMCacheOption] = {}
    prefixes: list[tuple[str, LMCacheOption]] = []
    for option in OPTIONS:
        for name in option.names:
            if name.endswith("*"):
                prefixes.append((name[:-1], option))
            else:
                if name in exact:
                    raise AssertionError(f"LMCache option {name!r} listed twice")
                exact[name] = option
    prefixes.sort(key=lambda item: -len(item[0]))
    return exact, prefixes


_EXACT, _PREFIXES = _build_index()


def find_option(name: str, *, extra: bool = False) -> LMCacheOption | None:
    """The entry for LMCache option ``name`` (without ``lmcache.``), or None when lmkv
    does not know it. ``extra``: ``name`` comes from ``kv_connector_extra_config``,
    where the multi-process keys (``mp.*``) live."""
    option = _EXACT.get(name)
    if option is None:
        option = next((o for p, o in _PREFIXES if name.startswith(p)), None)
    if option is not None and option.extra_only and not extra:
        return None
    return option


# -- translation ---------------------------------------------------------------------

@dataclass
class Translation:
    """What a set of LMCache options becomes: lmkv ``settings`` (dotted keys; the
    tiers as one ``tiers`` list), what was ``carried`` (option, how) and what was
    ``dropped`` (option, why). A carried option's lmkv key is None when it is
    lmkv's behaviour already (or a feature left off). ``errors``: values of the
    wrong type (one line each), of the options in ``invalid``."""

    settings: dict[str, Any] = field(default_factory=dict)
    carried: list[tuple[str, str | None]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    invalid: set[str] = field(default_factory=set)

    def nested(self) -> dict[str, Any]:
        """``settings`` as a config file's nested mapping."""
        out: dict[str, Any] = {}
        for dotted, value in self.settings.items():
            node = out
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return out


def translate(values: Mapping[str, Any], labels: Mapping[str, str] | None = None, *,
              extra: bool = False, tiers: bool = True, strict: bool = True) -> Translation:
    """Translate LMCache options ``values`` (name -> value, names without ``lmcache.``).

    ``labels``: how to name each option in an error (``LMCACHE_CHUNK_SIZE``,
    ``'chunk_size' (from c.yaml)``). ``tiers``: write the tiers LMCache's defaults
    make even when no tier option is set (``lmkv migrate``); otherwise only when
    one is. A value of the wrong type is a ConfigError, one line per value (with
    ``strict=False``, a line in ``errors``).
    """
    labels = labels or {}
    result = Translation()
    tier_values: dict[str, Any] = {}
    errors = result.errors
    for name, value in values.items():
        option = find_option(name, extra=extra)
        if option is None:  # (null or not: LMCache has no such option either)
            result.dropped.append((name, _UNKNOWN))
            continue
        if value is None and option.kind != "none":
            continue  # LMCache reads null as "its default" (lmkv's, for a key it maps)
        if option.kind == "none":
            # In a file, a family's settings are moot while its switch is off; in the
            # extra config every lmcache.* key asked for must be answered.
            moot = not extra and option.switch is not None and name != option.switch \
                and _is_off(values.get(option.switch, False))
            # A feature left off (or null: LMCache's default, off for a feature lmkv
            # lacks) asks for nothing lmkv lacks: carried, so the connector logs it.
            if moot or value is None or _is_off(value):
                result.carried.append((name, None))
            else:
                result.dropped.append((name, _plain(option.how)))
            continue
        parse = _TIER_PARSERS[name] if option.kind == "tiers" else option.parse
        try:
            parsed = parse(value) if parse is not None else value
        except NotCarried as exc:
            result.dropped.append((name, str(exc)))
            continue
        except ValueError as exc:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            errors.append(f"LMCache option {labels.get(name, repr(name))} = {shown}: {exc}")
            result.invalid.add(name)
            continue
        if option.kind == "key" and parsed is not NOTHING_TO_SET:
            assert option.key is not None
            result.settings[option.key] = parsed
            result.carried.append((name, option.key))
        elif option.kind == "tiers":
            tier_values[name] = parsed
        else:
            result.carried.append((name, None))
    if errors and strict:
        raise ConfigError("\n".join(errors))
    if tier_values or tiers:
        result.settings["tiers"] = _build_tiers(tier_values, result)
    return result


def _is_off(value: Any) -> bool:
    """``false``, ``0``, empty: how LMCache's files spell a feature left off."""
    if isinstance(value, str):
        return value.strip().lower() in ("", "false", "0")
    return value is False or (isinstance(value, (int, float, list, dict)) and not value)


def _plain(text: str) -> str:
    """Docs text for a terminal: without the backticks."""
    return text.replace("`", "")


def size_text(gib: float) -> str:
    """LMCache's GB number as an lmkv byte size: ``5`` -> ``5GiB``, ``0.5`` -> ``512MiB``."""
    n = int(gib * (1 << 30))  # LMCache's own rounding
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _build_tiers(v: Mapping[str, Any], result: Translation) -> list[dict[str, Any]]:
    """lmkv's tiers for LMCache's storage options (its defaults where unset)."""
    cpu_options: dict[str, Any] = {}
    if v.get("local_cpu") is False:
        result.dropped.append(("local_cpu", "lmkv keeps its memory tier (LMCache allocates "
                                            "max_local_cpu_size as a staging buffer even so)"))
    cpu_gib = v.get("max_local_cpu_size", DEFAULT_CPU_GIB)
    if int(cpu_gib * (1 << 30)) < MIN_CPU_BYTES:
        result.dropped.append(("max_local_cpu_size", f"{cpu_gib:g} GB is below the cpu "
                                                     "tier's least 4096 bytes; lmkv's "
                                                     "default 4GiB stays"))
    else:
        cpu_options["max_bytes"] = size_text(cpu_gib)
    if v.get("local_cpu_use_hugepages"):
        cpu_options["huge_pages"] = True
    tiers: list[dict[str, Any]] = [{"type": "cpu", "options": cpu_options}]

    disk = v.get("local_disk")
    disk_gib = v.get("max_local_disk_size")
    if disk:
        fs_options: dict[str, Any] = {"url": disk}
        if disk_gib:
            fs_options["max_bytes"] = size_text(disk_gib)
        else:
            result.dropped.append(("max_local_disk_size", "unset or 0: the fs tier has no "
                                   "budget and grows until the disk is full; set "
                                   "tiers.1.options.max_bytes"))
        tiers.append({"type": "fs", "options": fs_options})
    elif disk_gib:
        result.dropped.append(("max_local_disk_size", "no local_disk to size"))

    url = v.get("remote_url")
    extra = v.get("extra_config") or {}
    tier = _remote_tier(url, extra, result) if url else None
    if tier is not None:
        tiers.append(tier)
    if extra and (tier is None or tier["type"] != "mooncake"):
        result.dropped.append(("extra_config", "LMCache backend-specific settings; lmkv "
                                               "reads them for a mooncakestore:// "
                                               "remote_url only"))

    policy = v.get("cache_policy")
    if policy is not None:
        eviction = {"LRU": "lru", "LFU": "lfu"}.get(policy.upper())
        if eviction is None:
            result.dropped.append(("cache_policy", f"lmkv has no {policy} eviction; its "
                                   "policies are lru, lfu, arc, s3fifo (lru kept)"))
        elif eviction != "lru":
            for tier in tiers:
                tier["eviction"] = eviction
    for tier in tiers:
        if not tier["options"]:
            del tier["options"]
    return tiers


def _remote_tier(url: str, extra: Mapping[str, Any], result: Translation
                 ) -> dict[str, Any] | None:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        return {"type": "redis", "options": {"url": url}}
    if scheme == "s3":
        return {"type": "fs", "options": {"url": url}}
    if scheme == "mooncakestore":
        return {"type": "mooncake", "options": _mooncake_options(url, extra, result)}
    if scheme == "lm":
        why = ("LMCache's cache server; run an lmkv server there (lmkv server --host HOST "
               "--port PORT) and set mode: server, server.address: tcp://HOST:PORT")
    else:
        why = (f"lmkv has no {scheme + '://' if scheme else repr(url)} tier (tiers: cpu; fs "
               "for a directory, s3:// or fsspec; redis; mooncake for mooncakestore://)")
    result.dropped.append(("remote_url", why))
    return None


#: What LMCache's mooncakestore connector reads from ``extra_config``, as the
#: ``mooncake`` tier's options; sizes are bytes, with LMCache's defaults.
_MOONCAKE_TEXT = {"master_server_address": "master_address",
                  "metadata_server": "metadata_server", "local_hostname": "local_hostname",
                  "protocol": "protocol", "device_name": "device_name"}
_MOONCAKE_SIZES = {"global_segment_size": 3355443200, "local_buffer_size": 1073741824}
_MOONCAKE_NONE = {
    "storage_root_dir": "lmkv's mooncake tier keeps no entries on Mooncake's SSD offload",
    "prefer_local_alloc": "the master places each entry; the tier asks for no segment",
}


def _mooncake_options(url: str, extra: Mapping[str, Any], result: Translation
                      ) -> dict[str, Any]:
    """The ``mooncake`` tier's options for LMCache's ``mooncakestore://HOST:PORT[?device=]``
    and its ``extra_config``, as its connector reads them (the URL's master and device
    win over ``extra_config``'s); a key that does not carry over is a dropped line."""
    from urllib.parse import parse_qs, urlsplit

    options: dict[str, Any] = {}
    for name, value in extra.items():
        label = f"extra_config.{name}"
        if name in _MOONCAKE_NONE:
            result.dropped.append((label, _MOONCAKE_NONE[name]))
        elif name in _MOONCAKE_TEXT:
            if isinstance(value, str) and value.strip():
                options[_MOONCAKE_TEXT[name]] = value.strip()
            elif not (name == "device_name" and value == ""):
                result.dropped.append((label, f"{value!r} is not text; the tier's default "
                                              "stays"))
        elif name in _MOONCAKE_SIZES:
            size = _byte_count(value)
            if size is None:
                result.dropped.append((label, f"{value!r} is not a number of bytes; "
                                              "LMCache's default stays"))
            else:
                options[name] = size_text(size / (1 << 30)) if size else 0
        elif name == "transfer_timeout":  # LMCache's bound on one put, in seconds
            seconds = _byte_count(value) if not isinstance(value, float) else value
            if seconds is None or not math.isfinite(seconds) or seconds <= 0:
                result.dropped.append((label, f"{value!r} is not a positive number of "
                                              "seconds; the tier's call_timeout_s stays"))
            else:
                options["call_timeout_s"] = seconds
        else:
            result.dropped.append((label, "not an option of LMCache's mooncakestore "
                                          "connector; lmkv has no equivalent"))
    for name, default in _MOONCAKE_SIZES.items():
        options.setdefault(name, size_text(default / (1 << 30)))
    try:
        parts = urlsplit(url)
        host, port, query = parts.hostname, parts.port, parts.query
    except ValueError:
        host = port = None
        query = ""
    if host and port:
        options["master_address"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    elif "master_address" not in options:
        result.dropped.append(("remote_url", f"{url} names no master host:port and "
                                             "extra_config no master_server_address; the "
                                             "tier's default ($MOONCAKE_MASTER) stays"))
    device = parse_qs(query).get("device", [""])[0]
    if device:
        options["device_name"] = device
    order = ("master_address", "metadata_server", "local_hostname", "protocol",
             "device_name", "global_segment_size", "local_buffer_size", "call_timeout_s")
    return {name: options[name] for name in order if name in options}


def _byte_count(value: Any) -> int | None:
    """A whole number of bytes (an int or its digits), else None."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


# -- vLLM's kv_connector_extra_config ---------------------------------------------------

def extra_config_overrides(lmcache: Mapping[str, Any], extra: Mapping[str, Any]
                           ) -> dict[str, Any]:
    """The ``lmkv.*`` overrides for the ``lmcache.*`` keys of ``extra`` (``lmcache``:
    those keys without the prefix). A key with an lmkv name of its own is mapped and
    logged; one lmkv does not read (its storage keys, options without an equivalent,
    unknown names) is a ConfigError line that names the key and what to use instead."""
    labels = {name: repr(EXTRA_PREFIX + name) for name in lmcache}
    result = translate(lmcache, labels, extra=True, tiers=False, strict=False)
    lines = list(result.errors)
    overrides: dict[str, Any] = {}
    for name, why in result.dropped:
        if name not in lmcache:  # about an option left unset: the tiers line covers it
            continue
        lines.append(f"kv_connector_extra_config key {labels.get(name, name)}: lmkv does "
                     f"not read it: {why}")
    dropped = {name for name, _ in result.dropped} | result.invalid
    tier_names = [n for n in lmcache if (o := find_option(n, extra=True)) is not None
                  and o.kind == "tiers" and n not in dropped]
    if tier_names:
        tiers = result.settings.get("tiers")  # (none when every storage key is null)
        setting = f"\"lmkv.tiers\": {json.dumps(tiers)}" if tiers is not None else "\"lmkv.tiers\""
        lines.append(f"kv_connector_extra_config key(s) "
                     f"{', '.join(labels[n] for n in tier_names)}: lmkv does not read "
                     f"LMCache's storage keys; set {setting} instead "
                     "(LMCache's GB are GiB)")
    for name, key in result.carried:
        if key is None:
            logger.info("lmkv: %s%s needs no lmkv key (lmkv's behaviour)", EXTRA_PREFIX, name)
            continue
        target = "lmkv." + key
        if target in extra:
            lines.append(f"{EXTRA_PREFIX}{name} and {target} are both set; keep one")
            continue
        logger.info("lmkv: mapped %s%s to %s", EXTRA_PREFIX, name, target)
        overrides[target] = result.settings[key]
    if lines:
        raise ConfigError("\n".join(lines))
    return overrides


# -- docs/vllm.md's table ----------------------------------------------------------------

TABLE_BEGIN = "<!-- lmcache-map: generated from lmkv/config/lmcache.py; "\
              "python -m lmkv.config.lmcache docs/vllm.md -->"
TABLE_END = "<!-- lmcache-map: end -->"


def _shown_name(name: str, option: LMCacheOption) -> str:
    return f"`{EXTRA_PREFIX}{name}`" if option.extra_only or name.startswith("mp.") \
        else f"`{name}`"


def markdown_table() -> str:
    """The migration table docs/vllm.md carries, one row per entry of OPTIONS."""
    rows = ["| LMCache option | lmkv | how, or why there is none |", "| --- | --- | --- |"]
    for option in OPTIONS:
        names = ", ".join(_shown_name(n, option) for n in option.names)
        rows.append(f"| {names} | {option.lmkv or 'none'} | {option.how} |")
    return "\n".join(rows)


def replace_table(text: str) -> str:
    """``text`` with the part between TABLE_BEGIN and TABLE_END regenerated."""
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    end = text.index(TABLE_END)
    return text[:start] + "\n" + markdown_table() + "\n" + text[end:]


if __name__ == "__main__":  # python -m lmkv.config.lmcache docs/vllm.md
    import sys
    from pathlib import Path

    doc = Path(sys.argv[1])
    doc.write_text(replace_table(doc.read_text(encoding="utf-8")), encoding="utf-8")
