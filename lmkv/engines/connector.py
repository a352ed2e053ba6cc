"""The one place an engine's GPU connector is chosen and built.

The config's ``gpu_connector`` wins; otherwise the default connector for the
kind of KV the caller has (``kv_kind``: ``hf`` for transformers models,
``paged`` for vLLM; ``lmkv.config.model.DEFAULT_CONNECTORS``), resolved when the
config was loaded. A connector that takes another kind of KV is a one-line
ConfigError before any engine is opened. ``resolve_connector_class`` stops at
the class, for callers that ask it for the KV spec first (the vLLM worker: the
paged connector reads the layout and geometry from vLLM's caches).
"""

from __future__ import annotations

from lmkv.base.errors import ConfigError
from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import ConnectorContext, GPUConnector, KVSpec
from lmkv.plugins.resolved import Resolved

# What a caller that has each kind of KV serves, for the error line.
SERVES = {"hf": "a transformers model", "paged": "vLLM's paged KV caches"}


def resolve_connector_class(config: LMKVConfig, kv_kind: str | None
                            ) -> Resolved[GPUConnector]:
    """The connector class (and options) for ``kv_kind`` KV under ``config``. A
    caller that does not say (``None``) gets the config's connector unchecked, or
    the default for transformers-style KV."""
    resolved = config.plugins.connector_for(kv_kind or "hf")
    if kv_kind is not None and resolved.cls.kv_kind != kv_kind:
        raise ConfigError(
            f"gpu_connector = {resolved.cls.name!r}: cannot serve "
            f"{SERVES.get(kv_kind, kv_kind + ' KV')} (it takes "
            f"{resolved.cls.kv_kind or 'unknown'} KV); use a connector for {kv_kind} KV")
    return resolved


def resolve_connector(config: LMKVConfig, spec: KVSpec, kv_kind: str | None = None
                      ) -> GPUConnector:
    """The GPU connector for ``spec``, ``kv_kind`` KV, under ``config``."""
    return resolve_connector_class(config, kv_kind).create(ConnectorContext(spec))
