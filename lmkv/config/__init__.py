"""Layer 5: lmkv's configuration.

``model`` (the pydantic ``LMKVConfig``, ``load_config``: files, ``LMKV_*``
variables and dotted ``lmkv.*`` keys, every plugin resolved at load),
``suggestions`` (what an unknown key could have been), ``lmcache`` (LMCache's
options and what each becomes in lmkv).
"""

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
