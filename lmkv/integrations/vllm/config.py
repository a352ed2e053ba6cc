"""``kv_connector_extra_config`` -> ``LMKVConfig`` (dotted ``lmkv.*`` keys and aliases)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmkv.config import LMKVConfig, load_config
from lmkv.errors import ConfigError

logger = logging.getLogger(__name__)

#: LMCache multi-process keys accepted for their lmkv equivalents.
ALIASES = {
    "lmcache.mp.lazy_offload": "lmkv.lazy_offload",
    "lmcache.mp.lazy_offload_policy": "lmkv.lazy_offload_policy",
    "lmcache.mp.lazy_offload_threshold": "lmkv.lazy_offload_threshold",
    "lmcache.mp.lazy_offload_select_count": "lmkv.lazy_offload_select_count",
}


def extra_config_overrides(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``lmkv.*`` overrides in ``extra`` (aliases mapped; other keys ignored)."""
    overrides: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if key in ALIASES:
            target = ALIASES[key]
            if target in (extra or {}):
                raise ConfigError(f"{key} and {target} are both set; keep one")
            logger.info("lmkv: mapped %s to %s", key, target)
            overrides[target] = value
        elif key.startswith("lmkv."):
            overrides[key] = value
    return overrides


def config_from_extra(extra: Mapping[str, Any] | None) -> LMKVConfig:
    """Load the config: ``lmkv.config_file`` (if any), ``LMKV_*`` env, then the keys."""
    return load_config(overrides=extra_config_overrides(extra))

