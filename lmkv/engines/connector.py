"""The one place an engine's GPU connector is chosen and built.

``config.gpu_connector`` wins; otherwise the caller's default (``hf`` for
transformers models, ``paged`` with the detected layout for vLLM). A caller
that serves one kind of KV (``engine_kind``) gets a one-line ConfigError for a
connector that takes another, before any engine is opened.
"""

from __future__ import annotations

from lmkv.config import LMKVConfig, PluginRef, resolve_gpu_connector
from lmkv.errors import ConfigError
from lmkv.gpu import ConnectorContext, GPUConnector, KVSpec

# What a caller that needs each kind of KV serves, for the error line.
SERVES = {"hf": "a transformers model", "paged": "vLLM's paged KV caches"}


def resolve_connector(config: LMKVConfig, spec: KVSpec, *,
                      default: PluginRef | str = "hf",
                      engine_kind: str | None = None) -> GPUConnector:
    """The GPU connector for ``spec``: ``config.gpu_connector``, else ``default``."""
    if isinstance(default, str):
        default = PluginRef(type=default)
    connector = resolve_gpu_connector(config, default).create(ConnectorContext(spec))
    if engine_kind is not None and connector.engine_kind != engine_kind:
        raise ConfigError(
            f"gpu_connector = {connector.name!r}: cannot serve "
            f"{SERVES.get(engine_kind, engine_kind + ' KV')} (it takes "
            f"{connector.engine_kind or 'unknown'} KV); use {default.type!r} or another "
            f"connector for {engine_kind} KV")
    return connector
