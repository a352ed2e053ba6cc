"""``kv_connector_extra_config`` -> ``LMKVConfig`` (dotted ``lmkv.*`` keys; ``lmcache.*``
keys through lmkv.config.lmcache)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmkv.base.errors import ConfigError
from lmkv.config.lmcache import EXTRA_PREFIX
from lmkv.config.lmcache import extra_config_overrides as lmcache_overrides
from lmkv.config.model import LMKVConfig, load_config

logger = logging.getLogger(__name__)


def extra_config_overrides(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``lmkv.*`` overrides in ``extra``.

    ``lmcache.*`` keys with an lmkv name are mapped (logged); any other ``lmcache.*``
    key is an error naming what to use instead (lmkv.config.lmcache). A bare key that
    names an lmkv key (``chunk_size``) is an error too: lmkv reads only ``lmkv.*``.
    Other keys belong to someone else (another connector's settings left in place)
    and are ignored, with a warning.
    """
    extra = extra or {}
    overrides: dict[str, Any] = {}
    lmcache: dict[str, Any] = {}
    lines: list[str] = []
    for key, value in extra.items():
        if key.startswith(EXTRA_PREFIX):
            lmcache[key[len(EXTRA_PREFIX):]] = value
        elif key.startswith("lmkv."):
            overrides[key] = value
        elif key.split(".", 1)[0] in LMKVConfig.model_fields or key == "config_file":
            lines.append(f"kv_connector_extra_config key {key!r}: lmkv reads only lmkv.* "
                         f"keys there; write 'lmkv.{key}'")
        else:
            logger.warning("lmkv: kv_connector_extra_config key %r ignored (lmkv reads "
                           "lmkv.* keys)", key)
    if lmcache:
        try:
            overrides.update(lmcache_overrides(lmcache, extra))
        except ConfigError as exc:
            lines.extend(str(exc).splitlines())
    if lines:
        raise ConfigError("\n".join(lines))
    return overrides


def config_from_extra(extra: Mapping[str, Any] | None) -> LMKVConfig:
    """Load the config: ``lmkv.config_file`` (if any), ``LMKV_*`` env, then the keys."""
    return load_config(overrides=extra_config_overrides(extra))
