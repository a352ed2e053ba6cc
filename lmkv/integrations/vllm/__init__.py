"""vLLM integration: ``LMKVConnector`` (a ``KVConnectorBase_V1``).

Load it with ``kv_connector="LMKVConnector"`` and
``kv_connector_module_path="lmkv.integrations.vllm"``. Only ``connector``,
``metadata`` and ``worker`` import vLLM, and only when ``LMKVConnector`` is
first asked for: ``config`` and ``lazy`` stay importable without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LMKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMKVConnector":
        from lmkv.integrations.vllm.connector import LMKVConnector
        return LMKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
