"""The one place an engine's GPU connector is chosen and built.

``config.gpu_connector`` wins; otherwise the caller's default (``hf`` for
transformers models, ``paged`` for vLLM). A caller that serves one kind of KV
(``engine_kind``) gets a one-line ConfigError for a connector that takes
another, before any engine is opened. ``resolve_connector_class`` stops at the
class, for callers that ask it for the KV spec first (the vLLM worker: the
paged connector reads the layout and geometry from vLLM's caches).
"""

from __future__ import annotations

from lmkv.config import LMKVConfig, PluginRef, resolve_gpu_connector
from lmkv.errors import ConfigError
from lmkv.gpu import ConnectorContext, GPUConnector, KVSpec
from lmkv.plugins.resolved import Resolved

# What a caller that needs each kind of KV serves, for the error line.
SERVES = {"hf": "a transformers model", "paged": "vLLM's paged KV caches"}


def resolve_connector_class(config: LMKVConfig, *, default: PluginRef | str = "hf",
                            engine_kind: str | None = None) -> Resolved[GPUConnector]:
    """The connector class (and options) for ``config``: ``config.gpu_connector``,
    else ``default``; checked to take ``engine_kind`` KV when one is given."""
    if isinstance(default, str):
        default = PluginRef(type=default)
    resolved = resolve_gpu_connector(config, default)
    kind = resolved.cls.engine_kind
    if engine_kind is not None and kind != engine_kind:
        raise ConfigError(
            f"gpu_connector = {resolved.cls.name!r}: cannot serve "
            f"{SERVES.get(engine_kind, engine_kind + ' KV')} (it takes "
            f"{kind or 'unknown'} KV); use {default.type!r} or another "
            f"connector for {engine_kind} KV")
    return resolved


def resolve_connector(config: LMKVConfig, spec: KVSpec, *,
                      default: PluginRef | str = "hf",
                      engine_kind: str | None = None) -> GPUConnector:
    """The GPU connector for ``spec``: ``config.gpu_connector``, else ``default``."""
    resolved = resolve_connector_class(config, default=default, engine_kind=engine_kind)
    return resolved.create(ConnectorContext(spec))
