"""``lmkv config check``'s dry run: every plugin a config names, built and closed.

Validation alone would pass a config whose tier cannot start (a constructor
that refuses its options, a plugin that does not build). The dry run builds
each plugin the way the engine would, ``cls(options, context)``, with tiers
told it is a dry run (``BackendContext.dry_run``: no arena the size of
``max_bytes``), then closes it: a config that passes the check starts.
"""

from __future__ import annotations

import logging

from lmkv.base.errors import LMKVError
from lmkv.config.model import LMKVConfig

logger = logging.getLogger(__name__)

#: The KV a GPU connector is built for in a dry run: it needs one, any will do.
_STAND_IN = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}


def dry_run(config: LMKVConfig) -> list[str]:
    """Build and close every plugin ``config`` names; one line per one that cannot
    be built (empty: all of them were)."""
    import torch

    from lmkv.contracts.connector import ConnectorContext, KVSpec
    from lmkv.contracts.policy import OffloadContext
    from lmkv.storage.manager import StorageManager

    problems: list[str] = []
    try:
        storage = StorageManager.from_config(config, dry_run=True)
    except Exception as exc:
        problems.append(_one_line("tiers", exc))
    else:
        try:
            storage.close()
        except Exception as exc:  # a tier's close is the plugin's: one line
            problems.append(_one_line("tiers (closing)", exc))
    plugins = config.plugins
    try:
        plugins.offload_policy.create(OffloadContext(threshold=config.lazy_offload_threshold))
    except Exception as exc:
        problems.append(_one_line("lazy_offload_policy", exc))
    if plugins.gpu_connector is not None:
        spec = KVSpec(_STAND_IN["num_layers"], _STAND_IN["num_kv_heads"],
                      _STAND_IN["head_dim"], dtype=torch.float16)
        try:
            plugins.gpu_connector.create(ConnectorContext(spec=spec))
        except Exception as exc:
            problems.append(_one_line("gpu_connector", exc))
    return problems


def _one_line(where: str, exc: Exception) -> str:
    """lmkv's own error as it says it; a plugin's anything else, typed, on one line."""
    from lmkv.plugins.registry import describe_exception

    if isinstance(exc, LMKVError):
        return str(exc)
    return f"{where}: {describe_exception(exc)}"
