"""Cache engines: tokens in, KV out.

``open_engine(config, spec, ...)`` gives the engine the config asks for, typed
as the ``Engine`` protocol: ``local.LocalEngine`` (tiers in this process) or
``remote.RemoteEngine`` (tiers in an lmkv server). ``resolve_connector`` is
the one place a GPU connector is chosen.
"""

from __future__ import annotations

from lmkv.engines.connector import resolve_connector
from lmkv.engines.open import open_engine
from lmkv.engines.protocol import Engine, EngineCounters, RetrieveResult

__all__ = ["Engine", "EngineCounters", "RetrieveResult", "open_engine", "resolve_connector"]
