"""vLLM integration: ``LMKVConnector`` (a ``KVConnectorBase_V1``).

Load it with ``kv_connector="LMKVConnector"`` and
``kv_connector_module_path="lmkv.integrations.vllm"``. Importing this package
imports vLLM; nothing else in lmkv does.
"""

from __future__ import annotations

from lmkv.integrations.vllm.connector import LMKVConnector

__all__ = ["LMKVConnector"]
