"""Layer 5: lmkv's configuration.

``model`` (the pydantic ``LMKVConfig``, ``load_config``: files, ``LMKV_*``
variables and dotted ``lmkv.*`` keys, every plugin resolved at load),
``suggestions`` (what an unknown key could have been), ``lmcache`` (LMCache's
options and what each becomes in lmkv). The names below are imported on first
use: ``lmkv.config.lmcache`` alone (``lmkv migrate``) needs none of the model's
imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkv.base.exports import lazy_exports

_LAZY: dict[str, str] = {
    "CONFIG_ENV": "lmkv.config.model",
    "CurveConfig": "lmkv.config.model",
    "LMKVConfig": "lmkv.config.model",
    "LookupConfig": "lmkv.config.model",
    "MetricsConfig": "lmkv.config.model",
    "PluginRef": "lmkv.config.model",
    "ServerConnection": "lmkv.config.model",
    "TierConfig": "lmkv.config.model",
    "load_config": "lmkv.config.model",
    "read_config_file": "lmkv.config.model",
    "resolve_plugins": "lmkv.config.model",
}

if TYPE_CHECKING:
    from lmkv.config.model import (
        CONFIG_ENV,
        CurveConfig,
        LMKVConfig,
        LookupConfig,
        MetricsConfig,
        PluginRef,
        ServerConnection,
        TierConfig,
        load_config,
        read_config_file,
        resolve_plugins,
    )

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    "CONFIG_ENV",
    "CurveConfig",
    "LMKVConfig",
    "LookupConfig",
    "MetricsConfig",
    "PluginRef",
    "ServerConnection",
    "TierConfig",
    "load_config",
    "read_config_file",
    "resolve_plugins",
]
