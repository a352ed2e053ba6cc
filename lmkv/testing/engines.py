"""``open_local_engine``: ``open_engine`` for tests that look inside the engine.

Callers type against ``lmkv.engines.Engine``; a test that inspects the tiers
(``engine.storage``) or the keys (``engine.chunker``) needs the local engine,
and this says so, failing on a config that opens another kind.
"""

from __future__ import annotations

from typing import Any

from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import KVSpec
from lmkv.engines import open_engine
from lmkv.engines.local import LocalEngine


def open_local_engine(config: LMKVConfig, spec: KVSpec, *, model_name: str,
                      **kwargs: Any) -> LocalEngine:
    """``open_engine(config, spec, ...)``, which must give the in-process engine."""
    engine = open_engine(config, spec, model_name=model_name, **kwargs)
    if not isinstance(engine, LocalEngine):
        engine.close()
        raise TypeError(f"open_local_engine: config mode {config.mode!r} opened "
                        f"{type(engine).__name__}, not the in-process engine")
    return engine
